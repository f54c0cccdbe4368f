"""`ring_block_sparse`: block-sparse attention over a sequence sharded across ranks.

The block mask is `block_sparse`'s, on the global block indices. At step t rank r attends to the
K/V of rank s = r - t (mod W), which s sends to r directly (P2P, posted one step ahead). Every
rank knows the whole mask, so a (query rank, key rank) pair the mask drops entirely is neither
computed nor sent, and inside a step only the kept block pairs are computed. The backward
re-fetches the needed K/V the same way and returns each partial dK/dV straight to its owner.
Layouts: contiguous and zigzag hold whole blocks; striped gives every rank 1/W of every block
(block_size must be divisible by W), so local block a is global block a on every rank and the same
block mask applies to local blocks of block_size / W rows, with a causal diagonal that is
strict (key row < query row) when the held keys come from a later rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attention import primitive
from attention.autograd import bound_merged_attention
from attention.block_sparse import BlockSparseAttention, BlockSparseParams, check_block_sparse
from attention.errors import ParamError
from attention.hilbert import hilbert_permutation
from attention.layouts import check_seq_len
from attention.layouts import positions as layout_positions
from attention.primitive import accumulator_dtype, empty_result
from attention.registry import BenchParams, register
from attention.ring.comm import (
    RingComm,
    Tag,
)
from attention.ring.dense import checked_layout
from attention.ring.engine import Block, step_backward, step_forward, window_blocks
from attention.ring.needed import block_keys
from attention.ring.sharded import (
    HeadShape,
    ShardedKernel,
    check_placement,
    default_layout,
    sharded_spec,
)
from attention.ring.steps import clock

KV_TAGS = (Tag.SPARSE_KV_EVEN, Tag.SPARSE_KV_ODD)


@dataclass(frozen=True)
class RingBlockSparseParams(BlockSparseParams):
    """`block_sparse`'s parameters plus layout (contiguous | zigzag | striped; None: zigzag when
    causal, else contiguous) and group (a torch.distributed process group; None: the world)."""

    layout: str | None = None
    group: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_placement(self.layout, self.group)
        if self.plan != "auto":  # accepted only where it is honoured
            raise ParamError(
                "params.plan",
                f"{self.plan!r} selects block_sparse's single-process execution plan; "
                "ring_block_sparse runs its own per-step schedule (leave plan unset): its "
                "steps pair a query shard with another rank's K/V shard, which block_sparse's "
                "cuda plan (one FlexAttention call under one sequence's BlockMask) does not cut",
            )

    def twin(self) -> BlockSparseParams:
        """The single-process `block_sparse` parameters."""
        names = [f.name for f in dataclasses.fields(BlockSparseParams)]
        return BlockSparseParams(**{name: getattr(self, name) for name in names})


def _check_shards(params: RingBlockSparseParams, seq_len: int, world: int, layout: str) -> None:
    check_seq_len(seq_len, layout, world)
    if layout == "striped":
        if params.block_size % world:
            raise ParamError(
                "params.block_size",
                f"{params.block_size} must be divisible by world_size {world} "
                "for layout 'striped' (every rank holds 1/world_size of every block)",
            )
        return
    piece = seq_len // world // (2 if layout == "zigzag" else 1)
    if piece % params.block_size:
        what = "zigzag chunk" if layout == "zigzag" else "shard"
        raise ParamError(
            "seq_len",
            f"each {what} of {piece} tokens (seq_len {seq_len}, world_size {world}, "
            f"layout {layout!r}) must be divisible by params.block_size {params.block_size}",
        )


def check_ring_block_sparse(
    params: RingBlockSparseParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """`block_sparse`'s rules on the full length, then whole blocks in every shard or zigzag
    chunk, or 1/W of a block per rank when striped (layout in force: see `checked_layout`)."""
    check_block_sparse(params.twin(), seq_len=seq_len, world_size=1, num_heads=num_heads)
    _check_shards(params, seq_len, world_size, checked_layout(params.layout, causal))


def local_block_size(block_size: int, layout: str, world: int) -> int:
    """Rows of one block on one rank: all of it, or 1/W of it when striped."""
    return block_size // world if layout == "striped" else block_size


def _rank_blocks(seq_len: int, layout: str, rank: int, world: int, bs: int) -> torch.Tensor:
    """Global block indices of a rank's local blocks, in its local order."""
    return (
        layout_positions(seq_len, layout, rank, world)[:: local_block_size(bs, layout, world)] // bs
    )


class _Schedule:
    """Which block pairs every (rank, step) computes; from the global mask, same on all ranks."""

    def __init__(
        self, mask: torch.Tensor, seq_len: int, layout: str, world: int, bs: int, causal: bool
    ):
        self.world, self.bs, self.causal = world, bs, causal
        self.rows = local_block_size(bs, layout, world)  # rows of a block on one rank
        self.striped = layout == "striped"
        self.blocks = [_rank_blocks(seq_len, layout, r, world, bs) for r in range(world)]
        self.mask = mask
        self._plans: dict[tuple[int, int], list[Block]] = {}

    def sub_mask(self, rank: int, t: int) -> torch.Tensor:
        src = (rank - t) % self.world
        return self.mask[self.blocks[rank]][:, self.blocks[src]]

    def needs(self, rank: int, t: int) -> bool:
        """Whether `rank` computes anything at step t (else nothing is sent to it)."""
        return bool(self.plan(rank % self.world, t))

    def plan(self, rank: int, t: int) -> list[Block]:
        """Block pairs of step t: per local query block, runs of consecutive kept key blocks."""
        if (rank, t) not in self._plans:
            self._plans[rank, t] = self._make_plan(rank, t)
        return self._plans[rank, t]

    def _make_plan(self, rank: int, t: int) -> list[Block]:
        causal, bs, sub = self.causal, self.rows, self.sub_mask(rank, t)
        src = (rank - t) % self.world
        q_ids, k_ids = self.blocks[rank], self.blocks[src]
        strict = self.striped and src > rank
        out = []
        for a in range(sub.shape[0]):
            cols = sub[a].nonzero().flatten().tolist()
            runs: list[list[int]] = []
            for j in cols:
                if runs and runs[-1][1] == j:
                    runs[-1][1] = j + 1
                else:
                    runs.append([j, j + 1])
            for j0, j1 in runs:
                diag = causal and int(k_ids[j1 - 1]) == int(q_ids[a])
                out += _run_blocks(a, j0, j1, bs, diag, strict)
        return out


def _run_blocks(a: int, j0: int, j1: int, bs: int, diag: bool, strict: bool) -> list[Block]:
    """Query block a against the kept key blocks [j0, j1): one full rectangle, and when the run
    ends on the causal diagonal that block as a top-left causal one (shifted one row and key
    when `strict`), so no call needs an explicit mask."""
    q0, q1 = a * bs, (a + 1) * bs
    end = j1 - 1 if diag else j1
    blocks = [Block(q0, q1, j0 * bs, end * bs)] if j0 < end else []
    if diag and not strict:
        blocks.append(Block(q0, q1, end * bs, j1 * bs, causal=True))
    elif diag and bs > 1:
        blocks.append(Block(q0 + 1, q1, end * bs, j1 * bs - 1, causal=True))
    return blocks


def _exchange(comm: RingComm, sched: _Schedule, rank: int, t: int, send, recv) -> None:
    """Post step t's K/V transfer: mine to rank + t if it needs it, rank - t's into `recv`."""
    comm.start(
        send if sched.needs(rank + t, t) else None,
        recv if sched.needs(rank, t) else None,
        offset=t,
    )


def _forward(q, k, v, sched: _Schedule, group, scale: float):
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    if world == 1:  # one step: the output finished in accumulator windows (in q's dtype)
        blocks = sched.plan(rank, 0)

        def fill(c0: int, c1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
            mine = window_blocks(blocks, c0, c1)
            step_forward(q[:, c0:c1], k, v, mine, out, lse, scale, True)

        with clock.step("forward", 0):
            return primitive.windowed_result(
                q, fill, primitive.windows(q.shape[1], q.dtype, sched.rows)
            )
    out, lse = empty_result(q)
    mine = torch.stack((k, v))
    bufs = [torch.empty_like(mine), torch.empty_like(mine)]
    comms = [RingComm(group, tag) for tag in KV_TAGS]
    with clock.step("forward", 0):
        _exchange(comms[1], sched, rank, 1, mine, bufs[1])  # travels while step 0 computes
        fresh = step_forward(q, k, v, sched.plan(rank, 0), out, lse, scale, True)
    for t in range(1, world):
        with clock.step("forward", t):
            if t + 1 < world:  # post the next step's transfer before this step computes
                _exchange(comms[(t + 1) % 2], sched, rank, t + 1, mine, bufs[(t + 1) % 2])
            comms[t % 2].wait()
            kv = bufs[t % 2]
            fresh = step_forward(q, kv[0], kv[1], sched.plan(rank, t), out, lse, scale, fresh)
    return out, lse


def _backward(dout, q, k, v, out, lse, sched: _Schedule, group, scale: float):
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    dq = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=dq.dtype, device=k.device)

    def local_step() -> None:
        plan = sched.plan(rank, 0)
        step_backward((dout, q, out, lse), (k, v), plan, dq, dkv, scale)

    if world == 1:
        with clock.step("backward", 0):
            local_step()
        return dq, dkv[0], dkv[1]
    mine = torch.stack((k, v))
    bufs = [torch.empty_like(mine), torch.empty_like(mine)]
    comms = [RingComm(group, tag) for tag in KV_TAGS]
    back = RingComm(group, Tag.SPARSE_DKV)
    incoming = torch.empty_like(dkv)
    # Partial dK/dV sent home, double-buffered: step t's buffer is free again once step t - 1's
    # send completed (finish_return), which happens before step t + 1 reuses it.
    partials = [torch.empty_like(dkv), torch.empty_like(dkv)]
    pending: tuple[int, torch.Tensor | None] | None = None  # (step, partial sent)
    with clock.step("backward", 0):
        _exchange(comms[1], sched, rank, 1, mine, bufs[1])  # travels while step 0 computes
        local_step()

    def finish_return() -> None:
        step, _ = pending
        back.wait()
        if sched.needs(rank + step, step):  # rank + step computed with my block: its share
            dkv.add_(incoming)

    for t in range(1, world):
        with clock.step("backward", t):
            if t + 1 < world:
                _exchange(comms[(t + 1) % 2], sched, rank, t + 1, mine, bufs[(t + 1) % 2])
            comms[t % 2].wait()
            kv = bufs[t % 2]
            plan = sched.plan(rank, t)
            partial = None
            if plan:
                partial = partials[t % 2].zero_()
                step_backward((dout, q, out, lse), (kv[0], kv[1]), plan, dq, partial, scale)
            if pending is not None:
                finish_return()
            # my share of rank - t's dK/dV goes home; rank + t's share of mine comes in
            recv = incoming if sched.needs(rank + t, t) else None
            back.start(partial, recv, offset=-t)
            pending = (t, partial)
    with clock.step("backward", world):  # the last partial dK/dV, home
        finish_return()
    return dq, dkv[0], dkv[1]


def _ring_block_sparse(q, k, v, sched: _Schedule, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Direct K/V transfers of the needed steps, partial dK/dV sent home
    (attention.autograd.MergedFunction)."""
    scale = q.shape[-1] ** -0.5
    return bound_merged_attention(q, k, v, _forward, _backward, sched, group, scale)


class RingBlockSparseAttention(ShardedKernel):
    """Block-sparse attention on this rank's shard: `module(q, k, v, *, causal=False)`.

    Under ordering='hilbert' a rank holds its shard of the Hilbert-ordered sequence (see
    `local_positions`) and its output comes back in that order.
    """

    def __init__(self, params: RingBlockSparseParams) -> None:
        super().__init__(params)
        self.layout = params.layout
        self._twin = BlockSparseAttention(params.twin())

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Global (natural) positions of the tokens rank `rank` must pass, in its local order."""
        pos = super().local_positions(seq_len, rank, world_size, causal=causal)
        if self.params.ordering == "hilbert":
            return hilbert_permutation(seq_len)[pos]
        return pos

    def _schedule(self, seq_len: int, world: int, causal: bool) -> _Schedule:
        layout = default_layout(self.layout, causal)
        _check_shards(self.params, seq_len, world, layout)
        mask = self._twin.block_mask(seq_len, causal=causal)
        return _Schedule(mask, seq_len, layout, world, self.params.block_size, causal)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        group, _, world = self.join(q, k, v, causal)
        sched = self._schedule(q.shape[1] * world, world, causal)
        self.backend = primitive.backend_for(q.device, q.dtype)
        q, k, v = (t.contiguous() for t in (q, k, v))
        return _ring_block_sparse(q, k, v, sched, group if world > 1 else None)

    def rank_pairs(self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int) -> int:
        """This rank's kept block pairs, every step."""
        sched = self._schedule(seq_len * world, world, causal)
        return num_heads * sum(b.pairs() for t in range(world) for b in sched.plan(rank, t))

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """The whole shard of every step t >= 1 whose plan computes anything (the others are
        not sent), its rows no block of that step's plan keeps a pair with wasted
        (needed.block_keys); one pattern for every head."""
        sched = self._schedule(seq_len * world, world, causal)
        received = wasted = 0
        for t in range(1, world):
            if sched.needs(rank, t):
                received += seq_len
                wasted += seq_len - int(block_keys(sched.plan(rank, t), seq_len).sum())
        row = heads.row(heads.kv_heads)
        return received * row, wasted * row


register(
    sharded_spec(
        "ring_block_sparse",
        "Block-sparse attention across ranks: only the kept block pairs are computed, and "
        "K/V go only to the ranks whose query blocks keep them.",
        RingBlockSparseParams,
        RingBlockSparseAttention,
        check_ring_block_sparse,
        twin="block_sparse",
        bench_params=BenchParams(gpu={}),
    )
)
