"""A kernel builds a mask's plan once per shape, and the ring cuts it into K/V pieces once per
plan: a plan walks every tile in Python, host time that would otherwise be spent again in every
iteration (and, for the cut, inside every step the step clock times)."""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import run_ranks

import attention
from attention import dense as dense_module
from attention.ring import dense, engine
from attention.ring.engine import cut_pieces, cut_plan, frozen, piece_blocks

pytestmark = pytest.mark.timeout(120)

MASK = {"kind": "documents", "causal": True, "lengths": [24, 8, 40, 16, 40]}
"""Causal documents over 128 tokens: several tiles a step, partial steps and empty ones."""


def test_cut_plan_is_piece_blocks_cut_once() -> None:
    """cut_plan(plan)[i][t] is piece_blocks of step t and piece i, with the same pairs as the
    plan, and a second cut of an equal plan is the cache's answer."""
    module = attention.build("ring", mask=MASK, balance="per_document")
    world, n, p = 4, 32, 8
    plan = dense.plan_for(module.params, "zigzag", True, 1, world, n)
    pieces = tuple(cut_pieces(n, p, False))
    cut_plan.cache_clear()
    cut = cut_plan(frozen(plan), pieces, p, n)
    for piece, steps in zip(pieces, cut, strict=True):
        for t, blocks in enumerate(steps):
            assert list(blocks) == piece_blocks(plan[t], piece, p, n)
    pairs = sum(b.pairs() for steps in cut for blocks in steps for b in blocks)
    assert pairs == sum(b.pairs() for step in plan for b in step) > 0
    again = dense.plan_for(module.params, "zigzag", True, 1, world, n)  # equal, not the same
    assert cut_plan(frozen(again), pieces, p, n) is cut
    assert cut_plan.cache_info().hits == 1


def rank_twice(rank: int, world: int) -> dict:
    """Two forward+backward calls of one ring module at 64 tokens a rank, then another module
    at 32: the plans each builds (by shard size), and whether the two calls' gradients agree."""
    builds: list[int] = []
    real = dense.plan_for

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        builds.append(args[-1])  # n: the shard's tokens
        return real(*args, **kwargs)

    dense.plan_for = counted
    engine.PIECE_TOKENS = 16  # several K/V pieces a shard: the cut is used
    module = attention.build("ring", mask=MASK, balance="per_document")
    got = []
    for n in (64, 64):
        g = torch.Generator().manual_seed(rank)
        q, k, v, dout = (torch.randn(1, n, 2, 8, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        module(q, k, v, causal=True).backward(dout)
        got.append([q.grad, k.grad, v.grad])
    small = attention.build("ring", mask=MASK | {"lengths": [16, 8, 40]}, balance="head_tail")
    q, k, v = (torch.randn(1, 32, 2, 8) for _ in range(3))
    small(q, k, v, causal=True)
    dense.plan_for = real
    return {"builds": builds, "same": all(torch.equal(a, b) for a, b in zip(*got, strict=True))}


def test_ring_builds_its_plan_once_per_shape() -> None:
    """Each of two ranks builds the plan of 64 tokens once for two calls, and the other
    module's once; the second call's gradients equal the first's."""
    for rank in run_ranks(rank_twice, 2):
        assert rank["builds"] == [64, 32]
        assert rank["same"]


def test_dense_under_a_mask_builds_its_plan_once_per_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dense` with a mask builds the mask's plan once for two calls of one length (equal
    outputs), and once more for another length."""
    builds: list[int] = []
    real = dense_module.mask_plan

    def counted(mask, order, rank, world):  # type: ignore[no-untyped-def]
        builds.append(order.numel())
        return real(mask, order, rank, world)

    monkeypatch.setattr(dense_module, "mask_plan", counted)
    module = attention.build("dense", mask={"kind": "sliding_window", "causal": True, "window": 24})
    outs = []
    for n in (128, 128, 64):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, 2, 8, generator=g) for _ in range(3))
        outs.append(module(q, k, v, causal=True))
    assert builds == [128, 64]
    assert torch.equal(outs[0], outs[1])


def test_a_forward_block_runs_the_most_heads_its_own_rows_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forward's head group is bounded by the block's partial output (rows x heads x
    head_dim in fp32 within PIECE_BYTES): a 256-row tile runs its 4 heads in one fused call,
    a 1,024-row one in two, and the merged result equals one call of every head."""
    calls: list[int] = []
    real = engine.block_forward

    def counted(q: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(q.shape[2])  # the heads of this call
        return real(q, *args, **kwargs)

    monkeypatch.setattr(engine, "block_forward", counted)
    g = torch.Generator().manual_seed(0)
    heads, dim, n = 4, 64, 1024
    q, k, v = (torch.randn(1, n, heads, dim, generator=g) for _ in range(3))
    assert n * heads * dim * 4 > engine.PIECE_BYTES >= 256 * heads * dim * 4
    for rows, per_block in ((256, [4]), (1024, [2, 2])):
        blocks = [engine.Block(r0, r0 + rows, 0, n) for r0 in range(0, n, rows)]
        out, lse = engine.empty_result(q)
        calls.clear()
        engine.step_forward(q, k, v, blocks, out, lse, dim**-0.5, True, bounded=True)
        assert calls == per_block * len(blocks)
        want, want_lse = real(q, k, v, scale=dim**-0.5)
        torch.testing.assert_close(out, want.float())
        torch.testing.assert_close(lse, want_lse)
