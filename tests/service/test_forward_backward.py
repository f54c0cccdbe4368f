"""Forward and backward apart for kernel cells in train mode: each rank times both phases within
every timed iteration; the medians, their p10/p90 and the forward, backward and total TFLOP/s
reach results.json, results.csv, report.md and the run page, each recomputed here from the raw
per-iteration times the ranks stored."""

from __future__ import annotations

import csv
import io
import math
import statistics
from typing import Any

import pytest
import torch
from _api_helpers import api_client, run_in_process

from workers import kernels
from workers.config import RunConfig
from workers.protocol import run_case

API = "/api/v1"
SPEC = {
    "name": "forward and backward",
    "base": {"device": "cpu", "dtype": "float32", "num_heads": 2, "head_dim": 16,
             "seq_len": 512, "mode": "train", "iterations": 5, "warmup": 1},
    "grid": {"kernel": ["dense", "dilated"]},
}  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = ordered[math.floor(pos)]
    return lo + (ordered[math.ceil(pos)] - lo) * (pos - math.floor(pos))


def _measure_and_store(client: Any) -> int:
    """Submit SPEC; run each cell's case on this CPU and store it (run_in_process)."""
    return run_in_process(client, SPEC)


def test_a_train_rank_times_forward_and_backward_within_each_iteration() -> None:
    config = RunConfig.model_validate({**SPEC["base"], "kernel": "dense"})
    result = run_case(config).result
    assert result is not None and result.forward_times_s and result.backward_times_s
    fwd, bwd = result.forward_times_s, result.backward_times_s
    assert len(fwd) == len(bwd) == len(result.times_s) == 5
    for f, b, whole in zip(fwd, bwd, result.times_s, strict=True):
        assert f > 0 and b > 0 and f + b <= whole  # both inside the iteration's own time
    assert result.forward_s == statistics.median(fwd)
    assert result.backward_s == statistics.median(bwd)
    assert result.forward_p10_s == pytest.approx(_quantile(fwd, 0.1), rel=1e-12)
    assert result.forward_p90_s == pytest.approx(_quantile(fwd, 0.9), rel=1e-12)
    assert result.backward_p10_s == pytest.approx(_quantile(bwd, 0.1), rel=1e-12)
    assert result.backward_p90_s == pytest.approx(_quantile(bwd, 0.9), rel=1e-12)
    # the kernel's own FLOPs: forward alone, and forward + backward (3.5x for exact attention)
    module = kernels.build(config, torch.device("cpu"))
    assert result.forward_flops == module.flops(1, 512, 2, 16, False, backward=False)
    assert result.flops == module.flops(1, 512, 2, 16, False, backward=True)
    assert result.flops == pytest.approx(3.5 * result.forward_flops)


def test_forward_mode_stores_no_phases() -> None:
    config = RunConfig.model_validate({**SPEC["base"], "kernel": "dense", "mode": "forward"})
    result = run_case(config).result
    assert result is not None
    assert result.forward_s is None and result.forward_times_s is None
    assert result.forward_flops is None and result.backward_p90_s is None


def test_the_phases_reach_every_export_recomputed_from_the_raw_times(tmp_path: Any) -> None:
    with api_client(f"sqlite:///{tmp_path / 'phases.db'}") as client:
        sweep_id = _measure_and_store(client)
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        table = client.get(f"{API}/sweeps/{sweep_id}/results.csv").text
        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        assert len(rows) == 2 and "## Forward and backward (train mode)" in report
        by_run = {int(r["run_id"]): r for r in csv.DictReader(io.StringIO(table))}
        for row in rows:
            (rank,) = client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
            fwd, bwd = rank["forward_times_s"], rank["backward_times_s"]
            want = {
                "forward_s": statistics.median(fwd),
                "backward_s": statistics.median(bwd),
                "forward_p10_s": _quantile(fwd, 0.1),
                "forward_p90_s": _quantile(fwd, 0.9),
                "backward_p10_s": _quantile(bwd, 0.1),
                "backward_p90_s": _quantile(bwd, 0.9),
                "forward_tflops_per_s": rank["forward_flops"] / statistics.median(fwd) / 1e12,
                "backward_tflops_per_s": (rank["flops"] - rank["forward_flops"])
                / statistics.median(bwd)
                / 1e12,
                "tflops_per_s": rank["flops"] / statistics.median(rank["times_s"]) / 1e12,
            }
            for name, value in want.items():
                assert row[name] == pytest.approx(value, rel=1e-9), name
                assert float(by_run[row["run_id"]][name]) == pytest.approx(value, rel=1e-9)
            page = client.get(f"/runs/{row['run_id']}").text
            for name in ("forward_s", "backward_p90_s", "forward_tflops_per_s"):
                assert f"<th>{name}</th>" in page
            for name in ("forward_tflops_per_s", "backward_tflops_per_s", "tflops_per_s"):
                shown = f"<th>{name}</th><td>{row[name]:.4g} TFLOP/s</td>"
                assert shown in page, name  # as stored, in TFLOP/s: not SI-scaled again
            section = report.split("## Forward and backward (train mode)")[1].split("\n## ")[0]
            line = next(x for x in section.splitlines() if x.startswith(f"| {row['label']} |"))
            assert f"{row['forward_tflops_per_s']:,.4f}" in line
            assert f"{row['backward_tflops_per_s']:,.4f}" in line
