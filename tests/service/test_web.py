"""The read model and the dashboard logic without a browser: memory floor, known peaks,
baselines and scaling, labels, compare verdicts, and rows read back from a database (SQLite and
Postgres)."""

from __future__ import annotations

from typing import Any

import pytest
from _web_helpers import seed_sweeps
from sqlalchemy.orm import Session

from service.api import store
from service.db.engine import make_engine
from service.db.models import Sweep
from service.results import baselines, charts, compare, queries
from service.results.peaks import dense_peak_flops
from service.results.rows import RunRow, config_key, local_tokens, memory_floor
from service.results.stored import StoredRank
from service.spec import AnalysisSpec
from workers.noise import median_interval


def _row(run_id: int = 1, median: float | None = 1.0, spread: float = 0.05, **cfg: Any) -> RunRow:
    """A measured row the way service.results.rows builds it, from a config and one median per
    rank."""
    config: dict[str, Any] = {
        "kernel": "dense",
        "params": {},
        "seq_len": 1024,
        "world_size": 1,
        "batch_size": 1,
        "num_heads": 8,
        "head_dim": 64,
        "dtype": "float32",
        "mode": "forward",
        "causal": False,
        "parallel": "sequence",
    }
    config.update(cfg)
    row = RunRow(
        run_id=run_id,
        sweep_id=1,
        kernel=config["kernel"],
        params=config["params"],
        config=config,
        seq_len=config["seq_len"],
        world_size=config["world_size"],
        batch_size=config["batch_size"],
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        dtype=config["dtype"],
        causal=False,
        mode="forward",
        parallel=config["parallel"],
        searched=False,
        status="succeeded" if median is not None else "failed",
        attempts=1,
        error=None,
        environment_id=None,
        device="CPU",
        ranks=[],
        probes=[],
    )
    if median is not None:
        row.measured_seq_len = row.seq_len
        # 7 samples: their range is the median's interval at 98.4% (>= 95%: a change can be told)
        times = [median * (1 + spread * k / 3) for k in range(-3, 4)]
        row.median_s, row.p10_s, row.p90_s = median, times[0], times[-1]
        # as views does: the median's interval from the times
        found = median_interval(times)
        assert found is not None
        row.median_lo_s, row.median_hi_s, row.median_ci_level = found.lo, found.hi, found.level
        row.iterations = len(times)
        row.tokens_per_s = row.batch_size * row.seq_len / median
        row.peak_memory_bytes = 100
        row.ranks = [
            StoredRank(
                rank=0, seq_len=row.seq_len, times_s=times, median_s=median, p10_s=times[0],
                p90_s=times[-1], tokens_per_s=row.tokens_per_s, flops=1.0,
                flops_per_s=1.0 / median, peak_memory_bytes=100, backend="x",
            )
        ]  # fmt: skip
    return row


def test_memory_floor_matches_the_reference_figures() -> None:
    # h=8, d=64: 8.03 KiB/token in fp32 and 4.03 KiB in bf16 (q, k, v, out + fp32 lse).
    assert memory_floor("float32", 8, 64, 1) == 8 * 64 * 4 * 4 + 4 * 8 == 8224
    assert memory_floor("bfloat16", 8, 64, 1) == 4128
    # Sequence parallel: each rank holds seq/W tokens; data parallel: batch/W sequences.
    assert local_tokens("sequence", 2, 1, 4096) == 2048
    assert local_tokens("data", 2, 2, 4096) == 4096


def test_dense_peaks_known_devices_only() -> None:
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert dense_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert dense_peak_flops("NVIDIA A100-SXM4-80GB", "float16") == 312e12
    assert dense_peak_flops("CPU", "float32") is None
    assert dense_peak_flops(None, "float32") is None
    assert dense_peak_flops("NVIDIA GeForce GTX 1080", "bfloat16") is None  # no bf16 on Pascal


def test_peak_chart_says_no_reference_peak_on_cpu() -> None:
    row = _row()
    row.flops_per_s_per_rank = 1e11
    fig = charts.peak_fraction_figure([row])
    texts = [a["text"] for a in fig["layout"]["annotations"]]
    assert texts == ["no reference peak for CPU (float32) (achieved TFLOP/s is in the table)"]
    assert fig["data"] == []


def test_default_baselines_world_size_one_and_the_single_process_twin() -> None:
    rows = [
        _row(1, median=1.0),
        _row(2, median=1.0 / 1.5, kernel="ring", world_size=2),
        _row(3, median=2.0 / 1.9, world_size=2, parallel="data", batch_size=2),
        _row(4, median=0.5, world_size=1, batch_size=2),
        _row(5, median=0.25, kernel="block_sparse", params={"block_size": 64}),
        _row(6, seq_len=2048, kernel="ring", world_size=2),  # no W=1 run at 2048
        _row(7, median=1.0, seq_len=2048, world_size=2, parallel="data", batch_size=2),
    ]
    baselines.apply(rows, None)
    baselines.set_labels(rows)
    by_id = {r.run_id: r for r in rows}
    # ring W=2 -> its twin dense at W=1, strong scaling: 1.5x faster, 75% efficient.
    assert (by_id[2].baseline_run_id, by_id[2].baseline) == (1, "dense W=1")
    assert by_id[2].speedup == pytest.approx(1.5) and by_id[2].efficiency == pytest.approx(0.75)
    # data parallel keeps the global batch (2): its baseline is W=1 with batch 2.
    assert by_id[3].baseline_run_id == 4
    assert by_id[3].speedup == pytest.approx(0.5 / (2.0 / 1.9))
    # a sparse kernel is compared with dense of the same shape.
    assert (by_id[5].baseline_run_id, by_id[5].speedup) == (1, pytest.approx(4.0))
    # Without a W=1 run of the same global work, data parallelism falls back to one rank's
    # share (weak scaling, equal work per rank), named so; a ring does not (quadratic cost).
    assert by_id[6].baseline_run_id is None and by_id[1].baseline_run_id is None
    assert by_id[7].baseline is None  # no W=1 run at 2048 either
    points = charts.scaling_points(rows)
    ring = "ring · sequence-parallel · batch_size=1 · seq 1,024 (vs dense W=1)"
    assert points[ring] == [(1, 1.0), (2, pytest.approx(0.75))]


def test_weak_scaling_and_a_named_baseline() -> None:
    rows = [
        _row(1, median=1.0, batch_size=1),
        _row(2, median=1.25, world_size=2, parallel="data", batch_size=2),
    ]
    baselines.apply(rows, AnalysisSpec(scaling="weak"))
    assert rows[1].baseline_run_id == 1 and rows[1].efficiency == pytest.approx(0.8)
    rows = [
        _row(1, median=4.0, kernel="dilated", params={"dilation_rates": [1]}),
        _row(2, median=1.0, kernel="dilated", params={"dilation_rates": [2]}),
    ]
    baselines.apply(rows, AnalysisSpec(baseline={"params.dilation_rates": [1]}))
    assert (rows[1].baseline, rows[1].speedup) == ("dilation_rates=[1]", pytest.approx(4.0))
    assert rows[0].baseline is None  # a run is not its own baseline


def test_labels_show_only_what_varies_and_never_unset_values() -> None:
    bs = {"block_size": 128, "dilation": None, "num_global": None}
    rows = [
        _row(1, kernel="block_sparse", params={**bs, "sparsity_ratio": 0.1}),
        _row(2, kernel="block_sparse", params={**bs, "sparsity_ratio": 0.05}),
        _row(3, kernel="dense", world_size=2, parallel="data", batch_size=2),
    ]
    baselines.set_labels(rows)
    assert [r.label for r in rows] == [
        "block_sparse · block_size=128 · sparsity_ratio=0.1 · W=1 · batch_size=1",
        "block_sparse · block_size=128 · sparsity_ratio=0.05 · W=1 · batch_size=1",
        "dense · W=2 · data-parallel · batch_size=2",
    ]
    assert not any("None" in r.label for r in rows)


def test_compare_flags_time_only_outside_the_spread_and_memory_beyond_tolerance() -> None:
    base = {"kernel": "dense", "seq_len": 1024, "timeout_s": 60.0, "max_attempts": 1}
    assert config_key(base) == config_key({**base, "timeout_s": 600.0, "max_attempts": 3})
    assert config_key(base) != config_key({**base, "seq_len": 2048})
    a = [_row(1, median=1.0), _row(2, median=1.0, seq_len=2048), _row(3, seq_len=4096)]
    a.append(_row(4, seq_len=8192))
    b = [
        _row(11, median=1.08),  # 8% slower but the spreads (+-5%) overlap: noise
        _row(12, median=1.3, seq_len=2048),  # slower beyond both spreads
        _row(13, median=None, seq_len=4096),  # failed
    ]
    b[1].peak_memory_bytes = 150
    pairs = {p["a"].run_id: p for p in compare.compare_rows(a, b)}
    assert sorted(pairs) == [1, 2, 3]
    assert not pairs[1]["regression"] and pairs[1]["time_change"] is None
    assert pairs[2]["reasons"] == ["slower", "more memory"]
    assert pairs[3]["reasons"] == ["B failed"]
    assert compare.unmatched(compare.Sides(a), compare.Sides(b)) == (1, 0)
    # The chart is coloured by the metric it plots: a faster cell with more memory is green.
    faster = _row(21, median=0.3, seq_len=2048)
    faster.peak_memory_bytes = 300
    pair = compare.compare_rows([a[1]], [faster])
    fig = charts.compare_figure(pair)
    assert pair[0]["reasons"] == ["more memory"]
    assert fig["data"][0]["marker"]["color"] == [charts.CHANGE_COLOURS["faster"]]


def test_rows_read_back_from_the_database(database_url: str) -> None:
    seeded = seed_sweeps(database_url)
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            found = store.list_sweeps(session, skip=0, limit=50, kind=None, name=None)
            assert found.count == 3 and [s.id for s in found.data] == [3, 2, 1]
            maxlen = session.get(Sweep, seeded.maxlen)
            assert maxlen is not None
            rows = queries.sweep_rows(session, maxlen)
            best = {(r.kernel, r.world_size, r.parallel): r.max_seq_len for r in rows}
            assert best == {
                ("dense", 1, "sequence"): 1536,
                ("block_sparse", 1, "sequence"): 2048,
                ("ring", 2, "sequence"): 4096,
                ("dense", 2, "data"): 1536,
            }
            for r in rows:  # a search's numbers are those measured at its answer
                assert r.measured_seq_len == r.max_seq_len
                assert r.tokens_per_s == pytest.approx(r.batch_size * r.max_seq_len / r.median_s)
            bench = session.get(Sweep, seeded.benchmark)
            assert bench is not None
            ring = next(r for r in queries.sweep_rows(session, bench) if r.run_id == 3)
            # tokens/s over the slowest rank's median; peak memory is the largest rank's.
            assert ring.median_s == max(k.median_s for k in ring.ranks)
            assert ring.tokens_per_s == pytest.approx(2048 / ring.median_s)
            assert ring.peak_memory_bytes == max(ring.rank_peak_bytes)
            assert ring.device == "NVIDIA H100 80GB HBM3"
    finally:
        engine.dispose()
