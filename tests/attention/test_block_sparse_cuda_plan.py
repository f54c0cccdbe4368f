"""block_sparse's CUDA plan (attention.block_sparse.cuda: FlexAttention under a cached
BlockMask, every pattern), counted by bench.plan on the meta device: one fused call forward and
one backward at every length, the same aten ops at every length, no copy from the host and no
sync inside them, transients within a quarter of the floor at 128K; the BlockMask's tiles as the
CUDA kernel reads them hold each kept pair and no other; the plan that ran is in the backend
string. Correctness against the float64 masked reference is in test_block_sparse.py (every test
there runs both plans)."""

from __future__ import annotations

import pytest
import torch

import attention
from attention import block_sparse
from attention.block_sparse import cuda as block_sparse_flex
from attention.block_sparse import params as block_sparse_params
from attention.masks import block_token_mask
from bench import plan as bench_plan

pytestmark = pytest.mark.timeout(120)

FLEX = [
    {"block_size": 64, "pattern": "local_window", "window": 2},
    {"block_size": 64, "pattern": "global_local", "window": 1, "num_global": 1},
    {"block_size": 64, "pattern": "global_local", "window": 3, "num_global": 4},
    {"block_size": 64, "pattern": "dilated", "window": 2, "dilation": 2},
    {"block_size": 64, "pattern": "random", "num_random": 3, "seed": 1},
]
"""Every pattern with a fixed size parameter (global_local with its global blocks inside the
window and past it): their kept pairs per query block do not depend on the length, so the
plan's ops must not either."""


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("params", FLEX, ids=lambda p: "-".join(map(str, p.values())))
def test_the_flex_plan_makes_one_call_each_way_at_every_length(params, causal) -> None:
    """FlexAttention's plan counted by bench.plan (meta standing for CUDA) at 4K and 16K: one
    fused call forward and one backward, the same ops at both lengths, no host-to-device copy
    and no sync (the BlockMask is built by the uncounted first call and cached)."""
    rows = [
        bench_plan.count_plan(
            "block_sparse", params, "cuda", seq_len=s, heads=2, dim=8, causal=causal
        )
        for s in (4096, 16384)
    ]
    for row in rows:
        assert (row["fwd_calls"], row["bwd_calls"]) == (1, 1), row
        assert row["h2d_copies"] == 0 and row["syncs"] == 0, row
        assert row["backend"] == "flex-eager-plan-cuda", row
    assert (rows[0]["fwd_ops"], rows[0]["bwd_ops"]) == (rows[1]["fwd_ops"], rows[1]["bwd_ops"])
    assert rows[1]["fwd_ops"] <= 300 and rows[1]["bwd_ops"] <= 600, rows[1]


@pytest.mark.parametrize("tiles", [1, 2, 4])
@pytest.mark.parametrize("params", FLEX, ids=lambda p: "-".join(map(str, p.values())))
def test_the_flex_tiles_hold_each_kept_pair_and_no_other(params, tiles) -> None:
    """The BlockMask's tiles as FlexAttention's CUDA kernels read them (the forward's key-tile
    lists and the backward's query-tile lists; full tiles unmasked, partial ones through
    mask_mod) keep exactly the block mask's token pairs, causal or not, with a short last block
    and a partial last tile, tiles of 1, 2 and 4 blocks (CUDA: a multiple of FLEX_TILE). The
    eager op the CPU tests run applies mask_mod to every pair and ignores the tiles."""
    module = attention.build("block_sparse", plan="cuda", **{**params, "block_size": 4})
    for seq, causal in ((64, False), (62, True), (58, False), (64, True)):
        keep = block_token_mask(module.block_mask(seq), 4, causal=causal, seq_len=seq)
        mask = block_sparse_flex.build_block_mask(
            block_sparse_params._cached_block_mask(module.params, seq), seq, 4, causal, 4 * tiles,
            torch.device("cpu"),
        )  # fmt: skip
        for transposed in (False, True):
            pairs = block_sparse_flex.tile_pairs(mask, seq, transposed)
            assert torch.equal(pairs > 0, keep), (params, seq, causal, transposed)
            if tiles == 1:  # whole blocks: every kept pair off the causal diagonal is full
                assert (pairs == 2).sum() > 0
    # on CUDA whole blocks that Inductor's BLOCK_M / BLOCK_N (64, 128) divide
    sizes = {64: 128, 96: 384, 48: 384, 3: 384, 128: 128, 256: 256, 200: 3200}
    for block, tile in sizes.items():
        assert block_sparse_flex.tile_size(block, "cuda") == tile, block
        assert tile % block == 0 and tile % block_sparse_flex.FLEX_TILE == 0
    assert block_sparse_flex.tile_size(64, "cpu") == 64


def test_the_backend_names_the_plan_that_ran() -> None:
    """auto runs the CPU plan on CPU; a forced plan runs as asked, and says so."""
    q = torch.randn(1, 16, 1, 4)
    for plan, ran in (("auto", "cpu_flash-plan-cpu"), ("cpu", "cpu_flash-plan-cpu")):
        module = attention.build("block_sparse", block_size=4, window=1, plan=plan)
        module(q, q, q)
        assert module.backend == ran
    module = attention.build("block_sparse", block_size=4, window=1, plan="cuda")
    module(q, q, q)
    assert module.backend == "flex-eager-plan-cuda"
    assert block_sparse.resolve_plan("auto", torch.device("cuda")) == "cuda"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", list(bench_plan.BLOCK_SPARSE_PATTERNS))
def test_the_flex_plan_meets_issue_37s_targets_at_128k(pattern, causal) -> None:
    """bench.plan's patterns at density 0.25 (block 128) at 128K, h16 d128 bf16:
    one fused call forward and one backward, no copy or sync, transients within a quarter of
    the floor (FlexAttention's lse and max beyond it), ops within 300 / 600."""
    params = bench_plan.BLOCK_SPARSE_PATTERNS[pattern]
    row = bench_plan.count_plan("block_sparse", params, "cuda", seq_len=131072, causal=causal)
    assert (row["fwd_calls"], row["bwd_calls"]) == (1, 1), row
    assert row["h2d_copies"] == 0 and row["syncs"] == 0, row
    assert row["transient_bytes"] <= 0.25 * row["floor_bytes"], row
    assert row["bwd_transient_bytes"] <= 0.25 * row["bwd_floor_bytes"], row
    assert row["fwd_ops"] <= 300 and row["bwd_ops"] <= 600, row
