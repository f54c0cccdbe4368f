"""`python -m bench.gpu` as CI runs it (CPU, tiny shapes): exits 0, every check passes, and the
numbers of its markdown table are recomputed from the raw measurements of its JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_the_cpu_mode_checks_every_kernel_and_its_table_follows_the_raw_numbers(tmp_path) -> None:
    run = _run("--device", "cpu", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    setup, checks = lines[0]["setup"], [x for x in lines if "check" in x]
    rows = [x for x in lines if "kernel" in x]
    assert setup["device"] == "cpu" and setup["peak_tflops"] is None
    assert {c["check"] for c in checks} == {"dense", "dilated", "block_sparse"}
    for c in checks:
        assert c["ok"] and max(c["max_abs_error"].values()) <= c["tolerance"] == 1e-4, c
    dilated = next(c for c in checks if c["check"] == "dilated")
    assert dilated["params"]["dilation_rates"] == [1, 2, 4, 6, 12]  # LongNet's own rates
    assert [r["kernel"] for r in rows] == ["sdpa", "dense", "dilated", "block_sparse"]
    table = (tmp_path / "results.md").read_text()
    assert table in run.stdout
    sdpa = rows[0]
    for r in rows:  # FLOP/s from the FLOPs and the median (rounded to 1 us in the JSON)
        for flops, ms, rate in (("flops_fwd", "fwd_ms", "fwd_flop_s"),
                                ("flops_fwd_bwd", "fwd_bwd_ms", "fwd_bwd_flop_s")):  # fmt: skip
            assert abs(r[flops] / (r[ms]["median"] / 1e3) / r[rate] - 1) < 0.02
        frac = r["fwd_flop_s"] / sdpa["fwd_flop_s"]
        fb_frac = r["fwd_bwd_flop_s"] / sdpa["fwd_bwd_flop_s"]
        inputs, peak = r["inputs_bytes"], r["fwd_peak_above_inputs_bytes"]
        assert r["fwd_peak_over_floor"] == (inputs + peak) / r["floor_bytes"]
        row = (
            f"| {r['kernel']} | {r['seq']} | float32 | {r['fwd_ms']['median']:.2f} | "
            f"{r['fwd_bwd_ms']['median']:.2f} | {r['fwd_flop_s'] / 1e12:.3f} | {frac:.2f} | "
            f"{fb_frac:.2f} | - | {r['fwd_peak_over_floor']:.2f} | "
            f"{r['fwd_bwd_peak_above_inputs_bytes'] / 2**20:.1f} |"
        )
        assert row in table.splitlines(), (row, table)
    assert "need NCCL over two or more GPUs" in table


def test_a_dtype_it_cannot_check_is_one_clear_error(tmp_path) -> None:
    run = _run("--device", "cpu", "--dtypes", "float64", "--out", str(tmp_path))
    assert run.returncode == 2
    assert "--dtypes: 'float64' is not one of float32, float16, bfloat16" in run.stderr
    assert not (tmp_path / "results.jsonl").exists()
