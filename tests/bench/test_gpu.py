"""`python -m bench.gpu` as CI runs it (CPU, tiny shapes): exits 0, every check passes, and the
numbers of its markdown table are recomputed from the raw measurements of its JSON lines."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attention

ROOT = Path(__file__).resolve().parents[2]


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
    rows = [x for x in lines if "kernel" in x and "search" not in x]
    assert setup["device"] == "cpu" and setup["peak_tflops"] is None
    assert setup["gpus"] == [] and setup["torch"] and setup["python"]  # device_facts
    ring = ("ring", "ring_dilated", "ring_block_sparse")  # at W = 1, in a one-rank group
    kernels = ("dense", "dilated", "block_sparse", *ring, "primitive")
    assert {c["check"] for c in checks} == {*kernels, *(k + " causal" for k in kernels)}
    for c in checks:
        assert c["ok"] and max(c["max_abs_error"].values()) <= c["tolerance"] == 1e-4, c
    dilated = next(c for c in checks if c["check"] == "dilated")
    assert dilated["params"]["dilation_rates"] == [1, 2, 4, 6, 12]  # LongNet's own rates
    assert [r["kernel"] for r in rows] == ["sdpa", "dense", "dilated", "block_sparse", *ring]
    ring_dilated = next(c for c in checks if c["check"] == "ring_dilated")
    assert ring_dilated["params"] == dilated["params"]  # the twin's, through the ring engine
    table = (tmp_path / "results.md").read_text()
    assert table in run.stdout
    sdpa = rows[0]
    for r in rows:  # FLOP/s from the FLOPs and the median (rounded to 1 us in the JSON)
        for flops, ms, rate in (("flops_fwd", "fwd_ms", "fwd_flop_s"),
                                ("flops_fwd_bwd", "fwd_bwd_ms", "fwd_bwd_flop_s")):  # fmt: skip
            assert abs(r[flops] / (r[ms]["median"] / 1e3) / r[rate] - 1) < 0.02
        ratios = [] if r is sdpa else _pair_ratios(r, sdpa)
        frac = statistics.median(ratios) if ratios else 1.0
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        fb_frac = r["fwd_bwd_flop_s"] / sdpa["fwd_bwd_flop_s"]
        inputs, peak = r["inputs_bytes"], r["fwd_peak_above_inputs_bytes"]
        assert r["fwd_peak_over_floor"] == (inputs + peak) / r["floor_bytes"]
        row = (
            f"| {r['kernel']} | {r['seq']} | float32 | {r['fwd_ms']['median']:.2f} | "
            f"{r['fwd_bwd_ms']['median']:.2f} | {r['fwd_flop_s'] / 1e12:.3f} | {frac:.2f} | "
            f"{spread} | {fb_frac:.2f} | - | {r['fwd_peak_over_floor']:.2f} | "
            f"{r['fwd_bwd_peak_above_inputs_bytes'] / 2**20:.1f} |"
        )
        assert row in table.splitlines(), (row, table)
    assert "Ring kernels ran at W = 1 (a one-rank group). W > 1 needs NCCL over two" in table
    found = [x for x in lines if "search" in x]
    assert [(f["search"], f["kernel"]) for f in found] == [
        ("budget", "dense"), ("budget", "dilated"), ("budget", "block_sparse"),
        ("deliberate oom", "dense"),
    ]  # fmt: skip
    for f in found[:3]:  # each maximum fit and the next step up did not, as the probes say
        outcomes = {p["seq"]: p for p in f["probes"]}
        assert outcomes[f["max_seq"]]["outcome"] == "ok"
        over = [p for p in f["probes"] if p["outcome"] != "ok"]
        assert over and min(p["seq"] for p in over) <= f["max_seq"] + 256
        assert all(p["emulated"] and p["requested_bytes"] > f["budget_bytes"] for p in over)
        assert f"| budget | {f['kernel']} | 4 | {f['max_seq']} |" in table
    (oom,) = found[3]["probes"]
    assert oom["outcome"] == "over_budget" and oom["requested_bytes"] > 4 * 2**20


def _pair_ratios(row: dict, sdpa: dict) -> list[float]:
    """A kernel's forward FLOP/s over SDPA's, call by call, recomputed from the raw times of
    the alternating calls (the kernel's after SDPA's) and each side's FLOPs."""
    assert row["baseline"] == "sdpa" and len(row["fwd_ms_each"]) == len(row["baseline_fwd_ms"])
    assert statistics.median(row["fwd_ms_each"]) == pytest.approx(row["fwd_ms"]["median"], abs=6e-4)
    return [
        (row["flops_fwd"] / t) / (sdpa["flops_fwd"] / tb)
        for t, tb in zip(row["fwd_ms_each"], row["baseline_fwd_ms"], strict=True)
    ]


def test_an_allocator_error_gives_the_bytes_it_asked_for() -> None:
    from bench.gpu_search import requested_bytes

    message = (  # PyTorch's CUDA caching allocator message
        "CUDA out of memory. Tried to allocate 128.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 78.52 GiB is free."
    )
    assert requested_bytes(RuntimeError(message)) == 128 * 2**30
    assert requested_bytes(RuntimeError("Tried to allocate 1.50 MiB")) == int(1.5 * 2**20)
    assert requested_bytes(RuntimeError("some other failure")) is None


def test_a_dtype_it_cannot_check_is_one_clear_error(tmp_path) -> None:
    run = _run("--device", "cpu", "--dtypes", "float64", "--out", str(tmp_path))
    assert run.returncode == 2
    assert "--dtypes: 'float64' is not one of float32, float16, bfloat16" in run.stderr
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["dense", "dilated", "block_sparse"])
def test_the_chunked_reference_equals_the_whole_one(kernel, causal) -> None:
    """bench.gpu's 32K check runs the reference by query chunks under checkpoint: on 100
    tokens by chunks of 17 (across blocks of 8 and segments), its output and gradients equal
    the reference computed whole."""
    from bench.gpu import chunked_reference, reference

    params = {
        "dense": {},
        "dilated": {"segment_lengths": [24, 40, 100], "dilation_rates": [1, 3, 6]},
        "block_sparse": {"block_size": 8, "pattern": "local_window", "window": 2},
    }[kernel]
    module = attention.build(kernel, **params)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 100, 6, 8, generator=g, dtype=torch.float64) for _ in range(4))
    results = []
    for whole in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if whole:
            out = reference(kernel, module, *leaves, causal)
        else:
            out = chunked_reference(kernel, module, *leaves, causal, rows=17)
        results.append([out, *torch.autograd.grad(out, leaves, dout)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)
