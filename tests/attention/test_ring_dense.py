"""`ring` in real gloo processes: unshard(outputs) and gradients equal `dense` on the full tensors,
for W in {1, 2, 4}, every layout, causal or not; failures on one rank surface at once."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import RankFailed, run_ranks

import attention
from attention import layouts
from attention.base import causal_pairs
from attention.ring import engine
from attention.ring.dense import dense_plan
from attention.ring.engine import Block, restrict

pytestmark = pytest.mark.timeout(120)

SHAPE = (2, 64, 3, 8)  # batch, total seq, heads, head_dim (64 divides by 2 x 4)
CASES = [(layout, causal) for layout in layouts.LAYOUTS for causal in (False, True)]


def full_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient on the full sequence, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*SHAPE, generator=g) for _ in range(4))


def ring_case(rank: int, world: int, layout: str | None, causal: bool, seed: int) -> dict:
    """This rank's out and q/k/v gradients through `ring` for one configuration."""
    in_force = layout or ("zigzag" if causal else "contiguous")
    q, k, v, dout = (layouts.shard(t, in_force, rank, world) for t in full_inputs(seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    module = attention.build("ring", layout=layout)
    out = module(q, k, v, causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def rank_all_cases(rank: int, world: int) -> list[dict]:
    """Every (layout, causal) case with K/V cut into pieces of 8 rows (several pieces a shard),
    plus the default layout with whole-shard pieces, in one process group."""
    engine.PIECE_TOKENS = 8
    results = [ring_case(rank, world, lay, causal, seed=i) for i, (lay, causal) in enumerate(CASES)]
    engine.PIECE_TOKENS = 1024
    for i, causal in enumerate((True, False), start=len(CASES)):
        results.append(ring_case(rank, world, None, causal, seed=i))
    return results


def dense_reference(seed: int, causal: bool) -> dict:
    q, k, v, dout = full_inputs(seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention.build("dense")(q, k, v, causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_equals_dense_forward_and_grads(world):
    per_rank = run_ranks(rank_all_cases, world)
    cases = [*CASES, (None, True), (None, False)]
    for i, (layout, causal) in enumerate(cases):
        in_force = layout or ("zigzag" if causal else "contiguous")
        ref = dense_reference(i, causal)
        for name in ("out", "dq", "dk", "dv"):
            got = layouts.unshard([r[i][name] for r in per_rank], in_force)
            torch.testing.assert_close(
                got,
                ref[name],
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, n=name, c=(layout, causal): f"{n} {c}: {m}",
            )


def rank_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank one")
    q = torch.randn(1, 8, 2, 8)
    attention.build("ring")(q, q, q)  # rank 0 waits in the ring for rank 1


def rank_shape_mismatch(rank: int, world: int) -> None:
    n = 16 if rank == 1 else 8
    q = torch.randn(1, n, 2, 8)
    attention.build("ring", layout="contiguous")(q, q, q, causal=True)


def test_a_rank_that_raises_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*boom on rank one"):
        run_ranks(rank_raises, 2)
    assert time.monotonic() - start < 15


def test_shape_mismatch_on_one_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)same shape.*rank 1: q \(1, 16, 2, 8\)"):
        run_ranks(rank_shape_mismatch, 2)
    assert time.monotonic() - start < 15


def rank_errors(rank: int, world: int) -> list[str]:
    """Error messages a rank sees for invalid calls (each raised before any exchange)."""
    messages = []
    q = torch.randn(1, 5, 2, 8)
    try:
        attention.build("ring", layout="zigzag")(q, q, q, causal=True)
    except ValueError as exc:
        messages.append(str(exc))
    try:
        attention.build("ring")(q, q, q[:, :4])
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_invalid_calls_raise_clear_errors():
    (messages,) = run_ranks(rank_errors, 1)
    assert messages[0] == "seq_len: 5 must be divisible by 2 x world_size = 2 for layout 'zigzag'"
    assert messages[1].startswith("q, k, v: shapes must match")


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialised"):
        attention.build("ring")(q, q, q)


def test_params_and_validate():
    with pytest.raises(ValueError, match=r"params.layout: must be one of"):
        attention.build("ring", layout="spiral")
    with pytest.raises(ValueError, match=r"params.group: expected a torch.distributed"):
        attention.build("ring", group="world")
    with pytest.raises(ValueError, match=r"seq_len: 12 must be divisible by 2 x world_size = 8"):
        attention.validate("ring", {"layout": "zigzag"}, seq_len=12, world_size=4)
    with pytest.raises(ValueError, match=r"seq_len: 12 must be divisible by 2 x world_size = 8"):
        attention.validate("ring", {}, seq_len=12, world_size=4)  # causal unknown: zigzag rule
    with pytest.raises(ValueError, match=r"seq_len: 12 must be divisible by 2 x world_size = 8"):
        attention.validate("ring", {}, seq_len=12, world_size=4, causal=True)
    attention.validate("ring", {}, seq_len=12, world_size=4, causal=False)  # contiguous default
    attention.validate("ring", {"layout": "contiguous"}, seq_len=12, world_size=4)
    attention.validate("ring", {"layout": "striped"}, seq_len=12, world_size=4)
    assert attention.KERNELS["ring"].distributed


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_plans_cover_every_pair_once_and_balance(world):
    """Summed over ranks the plans compute exactly the dense/causal pairs; zigzag is balanced."""
    seq = 16 * world
    n = seq // world
    for layout in layouts.LAYOUTS:
        for causal in (False, True):
            per_rank = []
            for rank in range(world):
                plan = dense_plan(layout, causal, rank, world, n)
                per_rank.append(sum(b.pairs() for step in plan for b in step))
            expected = causal_pairs(seq) if causal else seq * seq
            assert sum(per_rank) == expected, (layout, causal)
            if layout == "zigzag" or not causal:
                assert len(set(per_rank)) == 1, (layout, causal, per_rank)
            if layout == "striped" and causal:
                assert max(per_rank) - min(per_rank) <= n * (world - 1)


def block_keep(blk: Block, n: int) -> torch.Tensor:
    """Token keep-mask (n, n) of a block (top-left causal inside its rectangle)."""
    keep = torch.zeros(n, n, dtype=torch.bool)
    sq, sk = blk.q1 - blk.q0, blk.k1 - blk.k0
    rect = torch.ones(sq, sk, dtype=torch.bool)
    keep[blk.q0 : blk.q1, blk.k0 : blk.k1] = rect.tril() if blk.causal else rect
    return keep


@pytest.mark.parametrize(
    "blk", [Block(0, 12, 0, 12, True), Block(4, 12, 0, 11, True), Block(2, 9, 3, 12)]
)
def test_restrict_splits_a_block_exactly(blk):
    """The parts of a block over a grid of row chunks and key pieces tile its mask once."""
    n, total = 12, torch.zeros(12, 12, dtype=torch.int64)
    for r0 in range(0, n, 5):
        for c0 in range(0, n, 4):
            for part in restrict(blk, r0, r0 + 5, c0, c0 + 4):
                shifted = Block(part.q0, part.q1, part.k0 + c0, part.k1 + c0, part.causal)
                assert r0 <= part.q0 < part.q1 <= r0 + 5 and 0 <= part.k0 < part.k1 <= 4
                total += block_keep(shifted, n).long()
    assert torch.equal(total, block_keep(blk, n).long())


@pytest.mark.parametrize("fold", [False, True])
def test_pieces_tile_the_shard_once(fold):
    pieces = engine.cut_pieces(32, 8, fold)
    rows = [i for piece in pieces for a, b in piece for i in range(a, b)]
    assert sorted(rows) == list(range(32))
    assert all(sum(b - a for a, b in piece) == 8 for piece in pieces)
    assert all(len(piece) == (2 if fold else 1) for piece in pieces)


@pytest.mark.parametrize("world", [2, 4])
def test_folded_pieces_give_every_rank_the_same_work_per_step(world):
    """Causal zigzag: with pieces from both halves every rank computes the same pairs at every
    (piece, step), so no rank waits for a slower neighbour; contiguous pieces do not."""
    n, p = 32, 8
    for fold in (True, False):
        pairs: dict[tuple[int, int], set[int]] = {}
        for rank in range(world):
            plan = dense_plan("zigzag", True, rank, world, n)
            for j, piece in enumerate(engine.cut_pieces(n, p, fold)):
                for t in range(world):
                    blocks = engine.piece_blocks(plan[t], piece, p, n)
                    pairs.setdefault((j, t), set()).add(sum(b.pairs() for b in blocks))
        assert all(len(per_rank) == 1 for per_rank in pairs.values()) == fold


# Each ring kernel with a rank-dependent parameter (differs between ranks), and its inputs.
RING_KERNELS = {
    "ring": ({"layout": "contiguous"}, {"layout": "striped"}),
    "ring_dilated": (
        {"segment_lengths": (8,), "dilation_rates": (1,)},
        {"segment_lengths": (8,), "dilation_rates": (2,)},
    ),
    "ring_block_sparse": (
        {"block_size": 4, "pattern": "local_window", "window": 1},
        {"block_size": 4, "pattern": "local_window", "window": 2},
    ),
}


def rank_disagreements(rank: int, world: int, kernel: str) -> list[str]:
    """Messages each rank gets when (1) rank 1 built the kernel with other parameters and
    (2) rank 1 alone passes a k that does not match its q: every rank raises, none waits."""
    same, other = RING_KERNELS[kernel]
    q = torch.randn(1, 16, 2, 8)
    messages = []
    try:
        attention.build(kernel, **(other if rank == 1 else same))(q, q, q)
    except ValueError as exc:
        messages.append(str(exc))
    k = q[:, :8] if rank == 1 else q
    try:
        attention.build(kernel, **same)(q, k, q)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


@pytest.mark.parametrize("kernel", sorted(RING_KERNELS))
def test_ranks_that_disagree_all_fail_fast(kernel):
    start = time.monotonic()
    per_rank = run_ranks(rank_disagreements, 2, kernel)
    assert time.monotonic() - start < 30
    for messages in per_rank:
        assert len(messages) == 2, messages
        assert messages[0].startswith("params: every rank of the ring must build the kernel")
    assert per_rank[1][1].startswith("q, k, v: shapes must match")
    assert per_rank[0][1].startswith("q, k, v: rank(s) 1 rejected their inputs")
