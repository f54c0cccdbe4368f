"""`ring_block_sparse` in real gloo processes equals `block_sparse` on the full tensors (out and
grads), for W in {1, 2, 4}, contiguous, zigzag and striped, every pattern, causal or not,
Hilbert order; steps the mask drops are neither computed nor sent."""

from __future__ import annotations

import pytest
from _dist_helpers import run_ranks
from _ring_helpers import assert_equals_twin, layout_cases, seeded_inputs, trained

import attention
from attention.hilbert import hilbert_permutation
from attention.ring.block_sparse import _Schedule
from attention.ring.engine import Block

pytestmark = pytest.mark.timeout(120)

SHAPE = (1, 64, 2, 8)
CONFIGS = [
    {"block_size": 4, "pattern": "local_window", "window": 1},
    {"block_size": 4, "pattern": "dilated", "window": 2, "dilation": 3},
    {"block_size": 4, "pattern": "global_local", "window": 1, "num_global": 1},
    {"block_size": 4, "pattern": "random", "num_random": 3, "seed": 5},
    {"block_size": 4, "pattern": "local_window", "sparsity_ratio": 0.25},
    {"block_size": 4, "pattern": "local_window", "window": 1, "ordering": "hilbert"},
]
CASES = layout_cases(CONFIGS)


def rank_cases(rank: int, world: int) -> list[dict]:
    results = []
    for i, (cfg, layout, causal) in enumerate(CASES):
        module = attention.build("ring_block_sparse", layout=layout, **cfg)
        pos = module.local_positions(SHAPE[1], rank, world, causal=causal)
        inputs = tuple(t[:, pos].clone() for t in seeded_inputs(i, SHAPE))
        results.append(trained(module, inputs, causal))
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_block_sparse_equals_block_sparse(world):
    per_rank = run_ranks(rank_cases, world)
    for i, (cfg, layout, causal) in enumerate(CASES):
        ref = trained(attention.build("block_sparse", **cfg), seeded_inputs(i, SHAPE), causal)
        perm = hilbert_permutation(SHAPE[1]) if cfg.get("ordering") == "hilbert" else None
        assert_equals_twin([r[i] for r in per_rank], layout, ref, (cfg, layout, causal), perm)


def test_dropped_steps_are_neither_computed_nor_sent():
    twin = attention.build("block_sparse", block_size=4, pattern="local_window", window=1)
    mask = twin.block_mask(64)
    sched = _Schedule(mask, 64, "contiguous", 4, 4, causal=False)  # 4 blocks a rank, window 1 block
    for rank in range(4):
        assert sched.needs(rank, 0)
        assert not sched.needs(rank, 2)  # two ranks away: no block within the window
        assert sched.plan(rank, 2) == []
    # step 1 holds rank - 1's keys, step 3 rank + 1's; the window does not wrap around
    assert [sched.needs(r, 1) for r in range(4)] == [False, True, True, True]
    assert [sched.needs(r, 3) for r in range(4)] == [True, True, True, False]
    causal = _Schedule(twin.block_mask(64, causal=True), 64, "contiguous", 4, 4, causal=True)
    assert [causal.needs(r, 3) for r in range(4)] == [False, False, False, False]
    assert [causal.needs(r, 1) for r in range(4)] == [False, True, True, True]


def test_striped_schedule_uses_local_blocks_and_a_strict_diagonal():
    """Striped: local block a is global block a on every rank (block_size / W rows); keys of a
    later rank on the diagonal block are strictly before the queries of the same local row."""
    twin = attention.build("block_sparse", block_size=4, pattern="local_window", window=0)
    sched = _Schedule(twin.block_mask(32, causal=True), 32, "striped", 2, 4, causal=True)
    # rank 0 holds tokens 0, 2, 4, ...: local block a, rows [2a, 2a+2), is global block a
    assert sched.plan(0, 0) == [
        Block(2 * a, 2 * a + 2, 2 * a, 2 * a + 2, causal=True) for a in range(8)
    ]
    # step 1 on rank 0 holds rank 1's keys (tokens 1, 3, ...): query 2a+2 sees key 2a+1 only
    assert sched.plan(0, 1) == [
        Block(2 * a + 1, 2 * a + 2, 2 * a, 2 * a + 1, causal=True) for a in range(8)
    ]
    assert sched.plan(1, 1) == [
        Block(2 * a, 2 * a + 2, 2 * a, 2 * a + 2, causal=True) for a in range(8)
    ]
    one_row = _Schedule(twin.block_mask(32, causal=True), 32, "striped", 4, 4, causal=True)
    assert one_row.plan(0, 1) == []  # one row a block: a later rank's diagonal key is after it
    assert not one_row.needs(0, 1)


def test_validate_names_the_shard_rules():
    params = {"block_size": 8, "pattern": "local_window", "window": 1}
    contiguous = {**params, "layout": "contiguous"}
    attention.validate("ring_block_sparse", contiguous, seq_len=64, world_size=8)
    with pytest.raises(ValueError, match=r"each zigzag chunk of 4 tokens .*params.block_size 8"):
        attention.validate("ring_block_sparse", params, seq_len=64, world_size=8)
    with pytest.raises(ValueError, match=r"each zigzag chunk of 15 tokens .*params.block_size 8"):
        attention.validate("ring_block_sparse", params, seq_len=60, world_size=2)
    striped = {**params, "layout": "striped"}
    attention.validate("ring_block_sparse", striped, seq_len=64, world_size=8)
    with pytest.raises(
        ValueError, match=r"params.block_size: 8 must be divisible by world_size 3 .*"
    ):
        attention.validate("ring_block_sparse", striped, seq_len=48, world_size=3)
    with pytest.raises(ValueError, match=r"params.window: conflicts with params.sparsity_ratio"):
        attention.build("ring_block_sparse", sparsity_ratio=0.5, **params)
    assert attention.KERNELS["ring_block_sparse"].distributed


def test_the_ring_refuses_a_plan_it_would_not_run():
    """`plan` picks block_sparse's single-process plan; the ring's per-step schedule is its own,
    so a ring accepts only the default, never a plan it would ignore (its twin keeps it)."""
    params = {"block_size": 8, "pattern": "local_window", "window": 1}
    attention.validate("ring_block_sparse", {**params, "plan": "auto"}, seq_len=64, world_size=2)
    for plan in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=r"^params\.plan: '.*' selects block_sparse's"):
            attention.build("ring_block_sparse", plan=plan, **params)
    twin = attention.registry.twin_params({**params, "plan": "auto", "layout": "zigzag"})
    assert attention.build("block_sparse", **twin).params.plan == "auto"
