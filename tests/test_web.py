"""Dashboard logic without a browser: memory floor, known peaks, scaling, compare verdicts, and
the result rows read back from a database (SQLite and Postgres)."""

from __future__ import annotations

from typing import Any

import pytest
from _web_helpers import seed_sweeps
from sqlalchemy.orm import Session

from service.db.engine import make_engine
from service.web import charts, data
from service.web.peaks import dense_peak_flops
from service.web.rows import config_key, memory_floor_bytes


def _row(**kw: Any) -> dict[str, Any]:
    row = {
        "run_id": 1,
        "kernel": "dense",
        "params": {},
        "variant": "dense",
        "seq_len": 1024,
        "world_size": 1,
        "dtype": "float32",
        "mode": "forward",
        "causal": False,
        "parallel": "sequence",
        "batch_size": 1,
        "num_heads": 8,
        "head_dim": 64,
        "status": "succeeded",
        "tokens_per_s": 1000.0,
        "peak_memory_bytes": 100,
        "max_seq_len": None,
        "probes": [],
    }
    row.update(kw)
    return row


def test_memory_floor_matches_the_reference_figures() -> None:
    # h=8, d=64: 8.03 KiB/token in fp32 and 4.03 KiB in bf16 (q, k, v, out + fp32 lse).
    assert memory_floor_bytes(_row(seq_len=1)) == 8 * 64 * 4 * 4 + 4 * 8 == 8224
    assert memory_floor_bytes(_row(seq_len=1, dtype="bfloat16")) == 4128
    # Sequence parallel: each rank holds seq/W tokens; data parallel: batch/W sequences.
    assert memory_floor_bytes(_row(seq_len=4096, world_size=2)) == 8224 * 2048
    row = _row(seq_len=4096, world_size=2, parallel="data", batch_size=2)
    assert memory_floor_bytes(row) == 8224 * 4096


def test_dense_peaks_known_devices_only() -> None:
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert dense_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert dense_peak_flops("NVIDIA A100-SXM4-80GB", "float16") == 312e12
    assert dense_peak_flops("CPU", "float32") is None
    assert dense_peak_flops(None, "float32") is None
    assert dense_peak_flops("NVIDIA GeForce GTX 1080", "bfloat16") is None  # no bf16 on Pascal


def test_peak_chart_says_no_reference_peak_on_cpu() -> None:
    fig = charts.peak_fraction_figure([_row(device="CPU", flops_per_s_per_rank=1e11)])
    texts = [a["text"] for a in fig["layout"]["annotations"]]
    assert texts == ["no reference peak for CPU (float32) (achieved TFLOP/s is in the table)"]
    assert fig["data"] == []


def test_scaling_uses_the_single_process_twin_as_baseline() -> None:
    rows = [
        _row(run_id=1, tokens_per_s=1000.0),
        _row(run_id=2, kernel="ring", variant="ring", world_size=2, tokens_per_s=1500.0),
        _row(run_id=3, world_size=2, parallel="data", batch_size=2, tokens_per_s=1900.0),
        _row(run_id=4, seq_len=2048, kernel="ring", variant="ring", world_size=2),  # no baseline
    ]
    points = charts.scaling_points(rows)
    assert points == {
        "ring · seq 1,024 (vs dense W=1)": [(1, 1.0), (2, 0.75)],
        "dense · data-parallel b=2 · seq 1,024": [(1, 1.0), (2, 0.95)],
    }


def test_compare_keys_ignore_timeouts_and_flag_regressions() -> None:
    base = {"kernel": "dense", "seq_len": 1024, "timeout_s": 60.0, "max_attempts": 1}
    assert config_key(base) == config_key({**base, "timeout_s": 600.0, "max_attempts": 3})
    assert config_key(base) != config_key({**base, "seq_len": 2048})
    a = [
        _row(run_id=1, config_key="x", tokens_per_s=100.0),
        _row(run_id=2, config_key="y", tokens_per_s=100.0, peak_memory_bytes=100),
        _row(run_id=3, config_key="z"),
        _row(run_id=4, config_key="only-a"),
    ]
    b = [
        _row(run_id=11, config_key="x", tokens_per_s=95.0),  # within the 10% tolerance
        _row(run_id=12, config_key="y", tokens_per_s=80.0, peak_memory_bytes=150),
        _row(run_id=13, config_key="z", status="failed", tokens_per_s=None),
    ]
    pairs = {p["a"]["run_id"]: p for p in data.compare_rows(a, b)}
    assert sorted(pairs) == [1, 2, 3]
    assert not pairs[1]["regression"] and pairs[1]["tps_ratio"] == pytest.approx(0.95)
    assert pairs[2]["reasons"] == ["slower", "more memory"]
    assert pairs[3]["reasons"] == ["B failed"]
    assert data.unmatched(a, b) == (1, 0)


def test_rows_read_back_from_the_database(database_url: str) -> None:
    seeded = seed_sweeps(database_url)
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            sweeps, total = data.list_sweeps(session)
            assert total == 3 and [s.id for s in sweeps] == [3, 2, 1]
            rerun = next(s for s in sweeps if s.id == seeded.rerun)
            assert rerun.counts == {"succeeded": 16, "failed": 1} and rerun.finished
            rows = data.sweep_rows(session, seeded.maxlen)
            best = {(r["kernel"], r["world_size"], r["parallel"]): r["max_seq_len"] for r in rows}
            assert best == {
                ("dense", 1, "sequence"): 1536,
                ("block_sparse", 1, "sequence"): 2048,
                ("ring", 2, "sequence"): 4096,
                ("dense", 2, "data"): 1536,
            }
            ring = next(r for r in data.sweep_rows(session, seeded.benchmark) if r["run_id"] == 3)
            # tokens/s over the slowest rank's median; peak memory is the largest rank's.
            assert ring["tokens_per_s"] == pytest.approx(2048 / ring["time_s"])
            assert ring["device"] == "NVIDIA H100 80GB HBM3"
            assert data.sweep_summary(session, 999) is None
    finally:
        engine.dispose()
