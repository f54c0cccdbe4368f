"""The ring loop: K/V travel the ring one hop per step, each step's block pairs go through the
(out, lse) primitive and merge; the backward sends dK/dV home along the ring with their blocks
(zhuzilin's ring-flash-attention scheme), so memory stays O(seq / W).

Who uses what: `ring` runs the whole loop (`ring_attention`, with a dense plan per layout);
`ring_block_sparse` uses the step functions (step_forward, step_backward) under its own loop,
because it sends K/V straight to the ranks that need them and skips the others, which a ring
that forwards every hop cannot; `ring_dilated` needs no ring (its segments are gathered among
the ranks they span). Message tags of all of them: attention.ring.comm.Tag.

A *plan* says, for each step t (holding the K/V of rank (rank - t) mod W), which block pairs of
(local queries, held keys) to compute; an empty step computes nothing but still forwards K/V.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attention import primitive
from attention.autograd import merged_attention
from attention.mask import Mask
from attention.masked_block import masked_backward, masked_forward
from attention.primitive import (
    block_backward,
    block_forward,
    empty_result,
    kv_head_pieces,
    merge_,
    zero_grads,
)
from attention.ring.comm import RingComm, Tag
from attention.ring.steps import clock

PIECE_TOKENS = 1024
"""Largest K/V piece and query chunk on CPU (rows of this rank's shard)."""
PIECE_BYTES = 1 << 19
"""CPU bound, in bytes, on the backward's K (or V) piece and on a forward block's fp32 partial
output. The backward holds four pieces of K/V or dK/dV (two receive buffers, two travelling
accumulators) and one block's gradients, so its memory beyond inputs, output and gradients is a
few MiB at any shard size. The forward, whose peak is well below the backward's, keeps
PIECE_TOKENS pieces (every piece costs a merge of each query row) and instead computes a
block a group of heads at a time. Small transients also keep glibc's heap from growing: freed
blocks of a few MiB stay resident and count in the process's resident-set peak (a rank's second
memory figure; its peak is the allocator's)."""
MIN_PIECE_TOKENS = 64
"""PIECE_BYTES never cuts pieces below this many rows (wide rows would make blocks too thin)."""


@dataclass(frozen=True)
class Block:
    """Queries [q0, q1) of this rank against keys [k0, k1) of the held block; `causal` is the
    primitive's top-left causal mask on that rectangle.

    `mask` (a partial tile of a mask, attention.ring.mask_plan): the block computes under the
    mask's exact predicate, row i and key j being the global tokens i + q_off and j + k_off
    (a block lies inside one run of consecutive tokens on each side, so the map is a shift)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    mask: Mask | None = None
    q_off: int = 0
    k_off: int = 0

    def keep(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The (rows, keys) predicate of a masked block (None: no mask)."""
        if self.mask is None:
            return None
        rows = torch.arange(self.q0 + self.q_off, self.q1 + self.q_off, device=device)
        keys = torch.arange(self.k0 + self.k_off, self.k1 + self.k_off, device=device)
        return self.mask.keep(rows[:, None], keys[None, :])

    def pairs(self) -> int:
        """Query-key pairs this block computes (for FLOP accounting)."""
        keep = self.keep()
        if keep is not None:
            return int(keep.sum())
        sq, sk = self.q1 - self.q0, self.k1 - self.k0
        if self.causal:
            full = max(0, sq - sk)  # rows below the square see every key
            m = min(sq, sk)
            return full * sk + m * (m + 1) // 2
        return sq * sk


Plan = Sequence[Sequence[Block]]
"""plan[t]: the blocks of step t (K/V of rank (rank - t) mod W)."""


def tile_forward(
    tile: tuple[torch.Tensor, ...], blk: Block, keep: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's (out, lse) on its (q, k, v) `tile`: the primitive's full or causal call, or
    under the mask's predicate `keep` (blk.keep())."""
    if keep is None:
        return block_forward(*tile, scale=scale, causal=blk.causal)
    return masked_forward(*tile, scale=scale, keep=keep)


def tile_backward(
    tile: tuple[torch.Tensor, ...], blk: Block, keep: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) from its (dout, q, k, v, out, lse) `tile`, as tile_forward."""
    if keep is None:
        return block_backward(*tile, scale=scale, causal=blk.causal)
    return masked_backward(*tile, scale=scale, keep=keep)


def step_forward(
    q: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    blocks: Sequence[Block],
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    fresh: bool,
    bounded: bool = False,
) -> bool:
    """Compute one step's blocks and merge them into (out, lse); returns whether (out, lse)
    are still untouched (`fresh`: the first full-height block is copied instead of merged).
    `bounded`: each block runs the most heads at a time whose partial output for the block's
    own rows fits PIECE_BYTES (_head_group), else all heads at once."""
    n, heads = q.shape[1], q.shape[2]
    for blk in blocks:
        g = _head_group(q, blk.q1 - blk.q0) if bounded else heads
        keep = blk.keep(q.device)
        for a0, a1, c0, c1 in _head_pieces(g, heads, kt.shape[2]):
            hs = slice(a0, a1)
            tile = (
                q[:, blk.q0 : blk.q1, hs],
                kt[:, blk.k0 : blk.k1, c0:c1],
                vt[:, blk.k0 : blk.k1, c0:c1],
            )
            o_b, l_b = tile_forward(tile, blk, keep, scale)
            o, s_ = out[:, blk.q0 : blk.q1, hs], lse[:, hs, blk.q0 : blk.q1]
            if fresh and blk.q0 == 0 and blk.q1 == n:
                o.copy_(o_b)
                s_.copy_(l_b)
            else:
                merge_(o, s_, o_b, l_b)
            del o_b, l_b
        fresh = False
    return fresh


@functools.lru_cache(maxsize=64)
def _head_pieces(g: int, heads: int, kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """Query heads in groups of g, each cut into kv_head_pieces (GQA)."""
    return tuple(
        p for h0 in range(0, heads, g) for p in kv_head_pieces(h0, h0 + g, heads, kv_heads)
    )


Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""What a backward reads of this rank's rows: (dout, q, out, lse) with the forward's final
merged (out, lse)."""


def block_grads(
    saved: Saved, kv: tuple[torch.Tensor, torch.Tensor], blk: Block, dq: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's backward against the held keys and values `kv`: adds its dq into `dq`,
    returns its (dk, dv) for the held keys."""
    dout, q, out, lse = saved
    kt, vt = kv
    rows, keys = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
    tile = (dout[:, rows], q[:, rows], kt[:, keys], vt[:, keys], out[:, rows], lse[:, :, rows])
    keep = blk.keep(q.device)
    dq_b, dk_b, dv_b = tile_backward(tile, blk, keep, scale)
    dq[:, blk.q0 : blk.q1] += dq_b
    return dk_b, dv_b


def step_backward(
    saved: Saved,
    kv: tuple[torch.Tensor, torch.Tensor],
    blocks: Sequence[Block],
    dq: torch.Tensor,
    dkv: torch.Tensor,
    scale: float,
) -> None:
    """One step's backward against the held (k, v) `kv`: dq into `dq`, each block's (dk, dv)
    into `dkv` (2, B, keys, H, D) as soon as it is computed (one block's gradients live at a
    time)."""
    for blk in blocks:
        dk_b, dv_b = block_grads(saved, kv, blk, dq, scale)
        dkv[0, :, blk.k0 : blk.k1] += dk_b
        dkv[1, :, blk.k0 : blk.k1] += dv_b
        del dk_b, dv_b  # else held while the next block computes: two blocks' at once


def restrict(blk: Block, r0: int, r1: int, c0: int, c1: int) -> list[Block]:
    """The parts of `blk` inside query rows [r0, r1) and keys [c0, c1), keys shifted by -c0.

    A causal block splits into a full rectangle (keys every row sees) and a top-left causal
    rest, so every part is again a primitive call.
    """
    a, b = max(blk.q0, r0), min(blk.q1, r1)
    c, d = max(blk.k0, c0), min(blk.k1, c1)
    if a >= b or c >= d:
        return []
    if not blk.causal:
        return [dataclasses.replace(blk, q0=a, q1=b, k0=c - c0, k1=d - c0, k_off=blk.k_off + c0)]
    parts = []
    e = min(d, blk.k0 + (a - blk.q0) + 1)  # keys up to here are seen by every row from a
    if c < e:
        parts.append(Block(a, b, c - c0, e - c0))
    s = max(c, e)
    first_row = blk.q0 + (s - blk.k0)  # the first row that sees key s
    if s < d and first_row < b:
        parts.append(Block(first_row, b, s - c0, d - c0, causal=True))
    return parts


def window_blocks(blocks: Sequence[Block], c0: int, c1: int) -> list[Block]:
    """The parts of `blocks` inside query rows [c0, c1), rows counted from c0 (a window's
    accumulators, primitive.windowed_result), keys unchanged; causal blocks split as in
    `restrict`, so every part is again a primitive call."""
    return [
        dataclasses.replace(part, q0=part.q0 - c0, q1=part.q1 - c0, q_off=part.q_off + c0)
        for blk in blocks
        for part in restrict(blk, c0, c1, 0, blk.k1)
    ]


def piece_size(n: int, device: torch.device, row_bytes: int = 0, parts: int = 1) -> int:
    """Rows of a K/V piece and of a query chunk: on CPU the largest divisor of n up to
    PIECE_TOKENS rows and, given `row_bytes` (bytes of one row of K), up to PIECE_BYTES bytes
    (but not under MIN_PIECE_TOKENS rows), which bounds buffers and temporaries; the whole shard
    on GPUs (big kernels). `parts`: the piece is that many equal runs, one from each
    n / parts rows of the shard (see cut_pieces), so its size is parts x a divisor of n / parts."""
    if device.type != "cpu":
        return n
    limit = PIECE_TOKENS
    if row_bytes > 0:
        limit = min(limit, max(MIN_PIECE_TOKENS, PIECE_BYTES // row_bytes))
    m = n // parts
    for pieces in range(1, m + 1):
        if m % pieces == 0 and parts * (m // pieces) <= limit:
            return parts * (m // pieces)
    return n


Piece = tuple[tuple[int, int], ...]
"""Rows of the shard that make one K/V piece: [start, end) runs, concatenated in this order."""


def cut_pieces(n: int, p: int, fold: bool) -> list[Piece]:
    """The shard's n rows as pieces of p rows: contiguous runs, or with `fold` half a piece from
    each half of the shard, rows [j h, (j+1) h) and [n/2 + j h, n/2 + (j+1) h) with h = p / 2.

    Folding balances causal zigzag: its step t > 0 needs either every key of one held chunk
    (the first half) or every query of one local chunk against all keys, so with contiguous
    pieces ranks get unequal work per piece and the ring, which syncs every piece, runs at the
    slower rank's pace; a folded piece gives every rank the same work at every step.
    """
    if not fold or p == n:
        return [((j, j + p),) for j in range(0, n, p)]
    h, c = p // 2, n // 2
    return [((j, j + h), (c + j, c + j + h)) for j in range(0, c, h)]


def _gather(x: torch.Tensor, piece: Piece, out: torch.Tensor | None) -> torch.Tensor:
    """The rows of `piece` from x (B, n, ...): a view for one run, else copied into `out`."""
    if len(piece) == 1:
        return x[:, piece[0][0] : piece[0][1]]
    if out is None:
        raise ValueError("_gather: a piece of several runs needs a buffer to copy into")
    off = 0
    for a, b in piece:
        out[:, off : off + b - a].copy_(x[:, a:b])
        off += b - a
    return out


def _scatter(x: torch.Tensor, piece: Piece, rows: torch.Tensor) -> None:
    """Write `rows` (B, p, ...), the piece's rows in piece order, back into x (B, n, ...)."""
    off = 0
    for a, b in piece:
        x[:, a:b] = rows[:, off : off + b - a]
        off += b - a


def _head_group(q: torch.Tensor, rows: int) -> int:
    """Heads per forward block: on CPU the most (a divisor of H) whose fp32 partial output for
    the block's `rows` query rows fits in PIECE_BYTES (at least 1); all heads on GPUs. Bounded
    by the block's rows, not its piece's: a mask's plan cuts pieces into many small tiles, and
    a head group more than needed is one more call and merge per tile."""
    bsz, _, heads, dim = q.shape
    if q.device.type != "cpu":
        return heads
    fits = [
        g for g in range(1, heads + 1) if heads % g == 0 and rows * bsz * g * dim * 4 <= PIECE_BYTES
    ]
    return max(fits, default=1)


def _row_bytes(k: torch.Tensor) -> int:
    """Bytes of one token row of k (all batches and heads)."""
    return k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()


KVComm = tuple[RingComm, RingComm]
"""The exchanges of K (Tag.K) and V (Tag.V) pieces."""


def kv_comms(group, members=None) -> KVComm | None:  # type: ignore[no-untyped-def]
    """The K and V exchanges of a ring over `group` (or its `members`, see RingComm)."""
    if group is None:
        return None
    return (RingComm(group, Tag.K, members), RingComm(group, Tag.V, members))


def _send_kv(comm: KVComm, kt: torch.Tensor, vt: torch.Tensor, buf: torch.Tensor) -> None:
    """Post K and V (as two messages: no stacked copy) to the next rank, receive into buf."""
    comm[0].start(kt.contiguous(), buf[0])  # a copy only when batch > 1 makes a slice strided
    comm[1].start(vt.contiguous(), buf[1])


def _wait_kv(comm: KVComm) -> None:
    comm[0].wait()
    comm[1].wait()


@functools.lru_cache(maxsize=64)
def cut_plan(
    plan: tuple[tuple[Block, ...], ...], pieces: tuple[Piece, ...], p: int, n: int
) -> tuple[tuple[tuple[Block, ...], ...], ...]:
    """cut[i][t]: the blocks of step t against the keys of pieces[i] (piece_blocks), cut once
    per plan and shape instead of inside every step of every call: a mask's plan of many small
    tiles takes milliseconds of Python to cut (per_document at 16K tokens on 4 ranks: 4.6 ms a
    call), which the step clock counted as compute and a GPU's kernels would wait for."""
    return tuple(tuple(tuple(piece_blocks(step, piece, p, n)) for step in plan) for piece in pieces)


def frozen(plan: Plan) -> tuple[tuple[Block, ...], ...]:
    """`plan` as nested tuples (cut_plan's cache key)."""
    return tuple(tuple(step) for step in plan)


def piece_blocks(plan_t: Sequence[Block], piece: Piece, p: int, n: int) -> list[Block]:
    """Blocks of one step restricted to the keys of `piece` (keys piece-local), split by
    query chunks of p rows."""
    parts, off = [], 0
    for a, b in piece:
        parts += [
            dataclasses.replace(part, k0=part.k0 + off, k1=part.k1 + off, k_off=part.k_off - off)
            for blk in plan_t
            for r0 in range(0, n, p)
            for part in restrict(blk, r0, r0 + p, a, b)
        ]
        off += b - a
    return parts


def _buffers(
    world: int, pieces: list[Piece], shape: tuple[int, ...], k: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Allocated once per call: the two K/V receive buffers (none when alone), and (K, V)
    buffers for my own piece when it is two runs (else (None, None): slices of k, v serve)."""
    folded = len(pieces[0]) > 1
    bufs = torch.empty((2 * (world > 1) + folded, *shape), dtype=k.dtype, device=k.device)
    own: list[torch.Tensor | None] = [bufs[-1][0], bufs[-1][1]] if folded else [None, None]
    return bufs, own


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    comm: KVComm | None,
    scale: float,
    fold: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out, lse fp32 (B,H,n)) over all steps; no autograd graph. out is fp32 (the
    accumulator dtype) on a ring of W > 1, whose every step merges into every row; alone
    (`comm` None) it is in q's dtype, finished in accumulator windows of rows
    (primitive.windowed_result: one window's rows in fp32 at a time, as the single-process
    kernels do).

    The shard's K/V are cut into pieces, each travelling its own ring in turn, so buffers and
    temporaries are a piece, not a shard; the transfer for step t+1 is posted before step t
    computes, into one of two receive buffers allocated once. Step 0 computes on (and sends)
    slices of k and v themselves (a copy when `fold` makes a piece of two runs, cut_pieces);
    blocks run a group of heads at a time (see PIECE_BYTES).
    """
    bsz, n, _, dim = q.shape
    world = 1 if comm is None else comm[0].world_size
    p = piece_size(n, q.device, parts=2 if fold else 1)
    pieces = cut_pieces(n, p, fold)
    bufs, own = _buffers(world, pieces, (2, bsz, p, k.shape[2], dim), k)
    if comm is None:
        return _alone_forward(q, k, v, plan[0], pieces, own, p, scale)
    out, lse = empty_result(q)
    cut = cut_plan(frozen(plan), tuple(pieces), p, n)
    for piece, piece_plan in zip(pieces, cut, strict=True):
        kt, vt = _gather(k, piece, own[0]), _gather(v, piece, own[1])
        for t in range(world):
            with clock.step("forward", t):
                if t < world - 1:
                    _send_kv(comm, kt, vt, bufs[t % 2])
                clock.computes(bool(plan[t]))  # an empty step: its K/V keep no pair here
                step_forward(q, kt, vt, piece_plan[t], out, lse, scale, False, bounded=True)
                if t < world - 1:
                    _wait_kv(comm)
                    kt, vt = bufs[t % 2][0], bufs[t % 2][1]
    return out, lse


def _alone_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: Sequence[Block],
    pieces: list[Piece],
    own: list[torch.Tensor | None],
    p: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_forward` on one rank (its only step): every K/V piece's blocks for one window of
    query rows at a time, merged into that window's accumulators."""
    n = q.shape[1]

    def fill(c0: int, c1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        for piece in pieces:
            kt, vt = _gather(k, piece, own[0]), _gather(v, piece, own[1])
            mine = window_blocks(piece_blocks(blocks, piece, p, n), c0, c1)
            step_forward(q[:, c0:c1], kt, vt, mine, out, lse, scale, False, bounded=True)

    with clock.step("forward", 0):
        clock.computes(bool(blocks))
        return primitive.windowed_result(q, fill, primitive.windows(n, q.dtype))


class _Accumulators:
    """ring_backward's dK/dV accumulators: acc[held] the held piece's (dk, dv), travelling one
    step behind its K/V; `home` my piece whose sum is on its last hop, into acc[1 - held].
    Without a dK/dV ring (`comm` None) one accumulator, scattered when its piece is done."""

    def __init__(
        self, world: int, shape: tuple[int, ...], dk: Tensor, dv: Tensor, comm: RingComm | None
    ) -> None:
        self.acc = torch.empty((1 + (world > 1), *shape), dtype=dk.dtype, device=dk.device)
        self.held = 0
        self.home: Piece | None = None
        self.dk, self.dv, self.comm = dk, dv, comm

    def add(self, blk: Block, dk_b: Tensor, dv_b: Tensor) -> None:
        """A block's (dk, dv) added into the held accumulator."""
        self.acc[self.held][0, :, blk.k0 : blk.k1] += dk_b
        self.acc[self.held][1, :, blk.k0 : blk.k1] += dv_b

    def arrive(self, t: int) -> None:
        """Complete the accumulator exchange: at t > 0 the held piece's accumulator from the
        previous rank; at t = 0 my previous piece's sum, which goes to dk, dv (and the
        accumulator just sent is free for the new piece)."""
        self.comm.wait()  # type: ignore[union-attr]
        if t > 0:
            self.held = 1 - self.held
        else:
            _scatter(self.dk, self.home, self.acc[1 - self.held][0])  # type: ignore[arg-type]
            _scatter(self.dv, self.home, self.acc[1 - self.held][1])  # type: ignore[arg-type]
            self.home = None
            self.acc[self.held].zero_()

    def start(self) -> None:
        """Send the held accumulator on (receiving the previous rank's into the other)."""
        if self.comm is not None:
            self.comm.start(self.acc[self.held], self.acc[1 - self.held])

    def done(self, piece: Piece) -> None:
        """`piece`'s W steps are done: without a ring its sum goes to dk, dv now; with one,
        it comes home after W hops, collected in the next piece's first step (or `finish`)."""
        if self.comm is None:
            _scatter(self.dk, piece, self.acc[self.held][0])
            _scatter(self.dv, piece, self.acc[self.held][1])
        else:
            self.home = piece


def _step_grads(
    saved: Saved,
    kv: tuple[Tensor, Tensor],
    blocks: Sequence[Block],
    dq: Tensor,
    scale: float,
    accs: _Accumulators,
    t: int,
) -> None:
    """One step's blocks: dq added in place, each block's (dk, dv) into the held accumulator.
    Unless it is ready for this step's shares, the accumulator exchange completes after the
    step's first block, so that it overlaps that block's compute."""
    ready = accs.comm is None or (t == 0 and accs.home is None)
    for blk in blocks:
        dk_b, dv_b = block_grads(saved, kv, blk, dq, scale)
        if not ready:
            accs.arrive(t)
            ready = True
        accs.add(blk, dk_b, dv_b)
        del dk_b, dv_b
    if not ready:
        accs.arrive(t)


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: Plan,
    kv_comm: KVComm | None,
    dkv_comm: RingComm | None,
    scale: float,
    fold: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq, dk, dv) of this rank's shard.

    K/V pieces travel as in the forward (`fold`: see cut_pieces); the dK/dV accumulator of the
    held piece travels with it one step behind and arrives home after W hops. Each exchange of
    accumulators completes after the next step's first block, whose compute it overlaps; every
    block's (dk, dv) is added into the accumulator as soon as it is computed, so beyond inputs,
    output and gradients a rank holds two K/V receive buffers (three with `fold`), two
    accumulators and one block's gradients.
    """
    bsz, n, _, dim = q.shape
    world = 1 if kv_comm is None else kv_comm[0].world_size
    p = piece_size(n, q.device, _row_bytes(k), parts=2 if fold else 1)
    pieces = cut_pieces(n, p, fold)
    dq, dk, dv = zero_grads(q, k)
    shape = (2, bsz, p, k.shape[2], dim)  # one allocation for each pair of buffers
    bufs, own = _buffers(world, pieces, shape, k)
    accs = _Accumulators(world, shape, dk, dv, dkv_comm)
    cut = cut_plan(frozen(plan), tuple(pieces), p, n)
    for piece, piece_plan in zip(pieces, cut, strict=True):
        kt, vt = _gather(k, piece, own[0]), _gather(v, piece, own[1])
        if accs.home is None:
            accs.acc[accs.held].zero_()
        for t in range(world):
            with clock.step("backward", t):
                if kv_comm is not None and t < world - 1:
                    _send_kv(kv_comm, kt, vt, bufs[t % 2])
                clock.computes(bool(plan[t]))
                _step_grads((dout, q, out, lse), (kt, vt), piece_plan[t], dq, scale, accs, t)
                accs.start()
                if kv_comm is not None and t < world - 1:
                    _wait_kv(kv_comm)
                    kt, vt = bufs[t % 2][0], bufs[t % 2][1]
        accs.done(piece)
    if accs.home is not None:
        with clock.step("backward", world):  # the last piece's dK/dV, home after W hops
            accs.arrive(0)
    return dq, dk, dv


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    group: Any,
    scale: float,
    fold: bool = False,
    members: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The ring loop with autograd (attention.autograd.MergedFunction): the backward rings
    dK/dV home. `group` None: one rank. `fold`: cut K/V pieces from both halves of the shard
    (cut_pieces; for causal zigzag). `members`: the ring is these ranks of `group` (usp)."""

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ring_forward(q, k, v, plan, kv_comms(group, members), scale, fold)

    def backward(dout, q, k, v, out, lse):  # type: ignore[no-untyped-def]
        dkv_comm = RingComm(group, Tag.DKV, members) if group is not None else None
        kv = kv_comms(group, members)
        return ring_backward(dout, q, k, v, out, lse, plan, kv, dkv_comm, scale, fold)

    return merged_attention(q, k, v, forward, backward)  # type: ignore[arg-type]
