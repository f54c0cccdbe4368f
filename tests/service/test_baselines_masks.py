"""Baselines under a mask and a balance: a sharded run with a `balance` finds its dense twin at
W=1 (dense takes no balance: it only orders the ranks' work), the mask is kept (dense takes
it, and a dense run of another mask is other work), and a kernel's default dense baseline
keeps its mask."""

from __future__ import annotations

from typing import Any

from test_web import _row

from attention.mask import expand
from service.results import baselines
from service.results.rows import RunRow

SAMPLED = {"distribution": "lognormal", "mean": 128, "max_fraction": 0.25, "seed": 0}
DOCS = expand({"kind": "documents", "causal": True, "sampled": SAMPLED}, 1024)
HALVES = {"kind": "documents", "causal": True, "lengths": [512, 512]}


def _masked(run_id: int, kernel: str, params: dict[str, Any], world: int = 1) -> RunRow:
    return _row(run_id, kernel=kernel, params=params, world_size=world, causal=True)


def _baseline(rows: list[RunRow], run_id: int) -> tuple[int | None, str | None]:
    baselines.apply(rows, None)
    (row,) = [r for r in rows if r.run_id == run_id]
    return row.baseline_run_id, row.baseline


def test_a_ring_with_a_balance_finds_its_dense_twin_under_the_same_mask() -> None:
    rows = [
        _masked(1, "dense", {"mask": HALVES}),
        _masked(2, "dense", {"mask": DOCS}),
        _masked(3, "ring", {"mask": DOCS, "balance": "ptrr", "layout": None}, world=2),
    ]
    assert _baseline(rows, 3) == (2, "dense W=1")
    assert baselines.same_work(rows[2], rows[1])  # a speedup above 2x is flagged
    assert not baselines.same_work(rows[2], rows[0])


def test_no_baseline_of_another_mask_or_of_none() -> None:
    rows = [
        _masked(1, "dense", {"mask": HALVES}),
        _masked(2, "dense", {}),
        _masked(3, "ring", {"mask": DOCS, "balance": "per_document"}, world=2),
    ]
    assert _baseline(rows, 3) == (None, None)


def test_the_default_dense_baseline_keeps_the_mask() -> None:
    rows = [
        _masked(1, "dense", {}),
        _masked(2, "dense", {"mask": DOCS}),
        _masked(3, "allgather_kv", {"mask": DOCS, "balance": "head_tail"}),
    ]
    assert _baseline(rows, 3) == (2, "dense")


def test_a_param_that_changes_the_result_is_not_dropped_for_the_twin() -> None:
    assert baselines.taken_params("dense", {"mask": DOCS, "balance": "ptrr"}) == {"mask": DOCS}
    inner = {"inner": "dilated", "segment_lengths": [256], "dilation_rates": [1]}
    assert baselines.taken_params("dense", inner) is None
    rows = [_masked(1, "dense", {}), _masked(2, "ulysses", inner, world=2)]
    assert _baseline(rows, 2) == (None, None)
