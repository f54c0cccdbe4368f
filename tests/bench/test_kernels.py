"""`bench/kernels.py` as a user runs it (tiny shapes): every kernel's forward is timed alternating
with dense's, and the x SDPA column and its min-max are recomputed from the raw times."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_x_sdpa_is_the_median_of_alternating_pairs_recomputed_from_the_raw_times() -> None:
    params = {"block_sparse": {"block_size": 32, "pattern": "local_window", "sparsity_ratio": 0.5}}
    run = subprocess.run(
        [sys.executable, "bench/kernels.py", "--seq", "256", "--heads", "2", "--dim", "16",
         "--repeats", "3", "--kernels", "block_sparse", "--params", json.dumps(params)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    dense, sparse = (x for x in lines if "kernel" in x)
    assert dense["kernel"] == "dense" and "fwd_pair_ratios" not in dense
    assert dense["fwd_frac_of_sdpa"] == 1.0
    assert sparse["baseline"] == "dense"
    ratios = [  # its FLOP/s over dense's, pair by pair: the call timed right after dense's
        (sparse["flops_fwd"] / t) / (dense["flops_fwd"] / tb)
        for t, tb in zip(sparse["fwd_ms_each"], sparse["baseline_fwd_ms"], strict=True)
    ]
    assert len(ratios) == 3 and sparse["fwd_pair_ratios"] == pytest.approx(ratios, rel=1e-12)
    assert sparse["fwd_frac_of_sdpa"] == pytest.approx(statistics.median(ratios), rel=1e-12)
    cpu = [
        (sparse["flops_fwd"] / t) / (dense["flops_fwd"] / tb)
        for t, tb in zip(sparse["fwd_cpu_ms_each"], sparse["baseline_fwd_cpu_ms"], strict=True)
    ]
    assert sparse["fwd_frac_of_sdpa_cpu"] == pytest.approx(statistics.median(cpu), rel=1e-12)
    assert statistics.median(sparse["fwd_ms_each"]) == pytest.approx(
        sparse["fwd_ms"]["median"], abs=6e-4
    )
    table = run.stdout[run.stdout.index("kernel ") :].splitlines()
    header, row = table[0].split(), next(x for x in table if x.startswith("block_sp/32"))
    assert header[7:9] == ["xSDPA", "(min-max)"]
    cells = row.split()
    assert cells[5] == f"{statistics.median(ratios):.2f}"
    assert cells[6] == f"{min(ratios):.2f}-{max(ratios):.2f}"


def test_forward_only_times_and_meters_no_backward_and_prints_dashes_for_it() -> None:
    """--forward-only (for 64K, where one dense forward+backward takes minutes here): the rows
    carry no backward time or peak, the table prints - in its two fb columns, and x SDPA is
    still the median of the alternating pairs."""
    run = subprocess.run(
        [sys.executable, "bench/kernels.py", "--seq", "256", "--heads", "2", "--dim", "16",
         "--repeats", "3", "--kernels", "dilated", "--forward-only"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"kernel"')]
    assert [r["kernel"] for r in rows] == ["dense", "dilated"]
    for r in rows:
        assert r["fwd_bwd_ms"] is None and r["fwd_bwd_peak_above_inputs_bytes"] is None, r
        assert r["fwd_ms"]["median"] > 0 and r["fwd_peak_over_floor"] > 0, r
    dilated = rows[1]
    table = run.stdout[run.stdout.index("kernel ") :].splitlines()
    cells = next(x for x in table if x.startswith("dilated")).split()
    assert cells[3] == "-" and cells[-1] == "-", cells  # fb ms, fb/dense
    assert cells[5] == f"{statistics.median(dilated['fwd_pair_ratios']):.2f}", cells


def test_paired_calls_alternate_baseline_first_and_a_baseline_of_another_shape_is_refused():
    from bench.kernels import make_case, paired_ms, time_case

    calls: list[str] = []
    mine, theirs = paired_ms(
        lambda: calls.append("kernel"), lambda: calls.append("base"), 3, torch.device("cpu")
    )
    assert calls == ["base", "kernel"] * 4  # one warm-up each, then 3 adjacent pairs
    assert [len(x) for x in (*mine, *theirs)] == [3, 3, 3, 3]
    args = argparse.Namespace(
        device="cpu", dtype=None, batch=1, heads=2, dim=16, causal=False, repeats=1
    )
    dense_128 = make_case("dense", {}, 128, args)
    with pytest.raises(ValueError, match=r"baseline: dense on \(1, 128, 2, 16\) cannot pair"):
        time_case(make_case("dense", {}, 256, args), args, dense_128)
