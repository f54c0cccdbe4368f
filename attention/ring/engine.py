"""The ring loop shared by the ring kernels: K/V travel the ring one hop per step, each step's
block pairs go through the (out, lse) primitive and merge; the backward sends dK/dV home along
the ring with their blocks (zhuzilin's ring-flash-attention scheme), so memory stays O(seq / W).

A *plan* says, for each step t (holding the K/V of rank (rank - t) mod W), which block pairs of
(local queries, held keys) to compute; an empty step computes nothing but still forwards K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention.primitive import block_backward, block_forward, merge_
from attention.ring.comm import RingComm

KV_TAG, DKV_TAG = 0, 1
PIECE_TOKENS = 1024
"""Largest K/V piece and query chunk on CPU (rows of this rank's shard)."""


@dataclass(frozen=True)
class Block:
    """Queries [q0, q1) of this rank against keys [k0, k1) of the held block; `causal` is the
    primitive's top-left causal mask on that rectangle, `mask` an optional keep-mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    mask: torch.Tensor | None = None

    def pairs(self) -> int:
        """Query-key pairs this block computes (for FLOP accounting)."""
        if self.mask is not None:
            keep = self.mask
            if self.causal:
                keep = keep & torch.ones(keep.shape[-2:], dtype=torch.bool).tril()
            return int(keep.sum()) // (keep.shape[0] if keep.dim() == 3 else 1)
        sq, sk = self.q1 - self.q0, self.k1 - self.k0
        if self.causal:
            full = max(0, sq - sk)  # rows below the square see every key
            m = min(sq, sk)
            return full * sk + m * (m + 1) // 2
        return sq * sk


Plan = Sequence[Sequence[Block]]
"""plan[t]: the blocks of step t (K/V of rank (rank - t) mod W)."""


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack((k, v))


def step_forward(
    q: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    blocks: Sequence[Block],
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    fresh: bool,
) -> bool:
    """Compute one step's blocks and merge them into (out, lse); returns whether (out, lse)
    are still untouched (`fresh`: the first full-height block is copied instead of merged)."""
    n = q.shape[1]
    for blk in blocks:
        o_b, l_b = block_forward(
            q[:, blk.q0 : blk.q1],
            kt[:, blk.k0 : blk.k1],
            vt[:, blk.k0 : blk.k1],
            scale=scale,
            causal=blk.causal,
            mask=blk.mask,
        )
        if fresh and blk.q0 == 0 and blk.q1 == n:
            out.copy_(o_b)
            lse.copy_(l_b)
        else:
            merge_(out[:, blk.q0 : blk.q1], lse[:, :, blk.q0 : blk.q1], o_b, l_b)
        fresh = False
    return fresh


def step_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: Sequence[Block],
    dq: torch.Tensor,
    scale: float,
) -> list[tuple[Block, torch.Tensor, torch.Tensor]]:
    """One step's block backward: adds into dq, returns each block's (dk, dv) to place."""
    grads = []
    for blk in blocks:
        dq_b, dk_b, dv_b = block_backward(
            dout[:, blk.q0 : blk.q1],
            q[:, blk.q0 : blk.q1],
            kt[:, blk.k0 : blk.k1],
            vt[:, blk.k0 : blk.k1],
            out[:, blk.q0 : blk.q1],
            lse[:, :, blk.q0 : blk.q1],
            scale=scale,
            causal=blk.causal,
            mask=blk.mask,
        )
        dq[:, blk.q0 : blk.q1] += dq_b
        grads.append((blk, dk_b, dv_b))
    return grads


def add_kv_grads(dkv: torch.Tensor, grads: list[tuple[Block, torch.Tensor, torch.Tensor]]) -> None:
    """Accumulate blocks' (dk, dv) into dkv (2, B, n, H, D) at their key rows."""
    for blk, dk_b, dv_b in grads:
        dkv[0, :, blk.k0 : blk.k1] += dk_b
        dkv[1, :, blk.k0 : blk.k1] += dv_b


def restrict(blk: Block, r0: int, r1: int, c0: int, c1: int) -> list[Block]:
    """The parts of `blk` inside query rows [r0, r1) and keys [c0, c1), keys shifted by -c0.

    A causal block splits into a full rectangle (keys every row sees) and a top-left causal
    rest, so every part is again a primitive call. Blocks with a mask are not split.
    """
    if blk.mask is not None:
        raise ValueError("restrict: blocks with an explicit mask are not split")
    a, b = max(blk.q0, r0), min(blk.q1, r1)
    c, d = max(blk.k0, c0), min(blk.k1, c1)
    if a >= b or c >= d:
        return []
    if not blk.causal:
        return [Block(a, b, c - c0, d - c0)]
    parts = []
    e = min(d, blk.k0 + (a - blk.q0) + 1)  # keys up to here are seen by every row from a
    if c < e:
        parts.append(Block(a, b, c - c0, e - c0))
    s = max(c, e)
    first_row = blk.q0 + (s - blk.k0)  # the first row that sees key s
    if s < d and first_row < b:
        parts.append(Block(first_row, b, s - c0, d - c0, causal=True))
    return parts


def piece_size(n: int, device: torch.device) -> int:
    """Rows of a K/V piece and of a query chunk: the largest divisor of n up to PIECE_TOKENS on
    CPU (bounds buffers and temporaries to n / pieces), the whole shard on GPUs (big kernels)."""
    if device.type != "cpu":
        return n
    for pieces in range(1, n + 1):
        if n % pieces == 0 and n // pieces <= PIECE_TOKENS:
            return n // pieces
    return n


def _piece_blocks(plan_t: Sequence[Block], j: int, p: int, n: int) -> list[Block]:
    """Blocks of one step restricted to key piece j (keys piece-local), split by query chunks."""
    return [
        part
        for blk in plan_t
        for r0 in range(0, n, p)
        for part in restrict(blk, r0, r0 + p, j * p, (j + 1) * p)
    ]


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    comm: RingComm | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out fp32 (B,n,H,D), lse fp32 (B,H,n)) over all steps; no autograd graph.

    The shard's K/V are cut into pieces, each travelling its own ring in turn, so buffers and
    temporaries are a piece, not a shard; the transfer for step t+1 is posted before step t
    computes, into one of two receive buffers allocated once.
    """
    bsz, n, heads, dim = q.shape
    world = 1 if comm is None else comm.world_size
    p = piece_size(n, q.device)
    out = torch.zeros(bsz, n, heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((bsz, heads, n), float("-inf"), dtype=torch.float32, device=q.device)
    bufs = [torch.empty((2, bsz, p, heads, dim), dtype=k.dtype, device=k.device) for _ in "ab"]
    for j in range(n // p):
        cur = _pack(k[:, j * p : (j + 1) * p], v[:, j * p : (j + 1) * p])
        for t in range(world):
            if comm is not None and t < world - 1:
                comm.start(cur, bufs[t % 2])
            step_forward(q, cur[0], cur[1], _piece_blocks(plan[t], j, p, n), out, lse, scale, False)
            if comm is not None and t < world - 1:
                comm.wait()
                cur = bufs[t % 2]
    return out, lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: Plan,
    kv_comm: RingComm | None,
    dkv_comm: RingComm | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq, dk, dv) of this rank's shard.

    K/V pieces travel as in the forward; the dK/dV accumulator of the held piece travels with
    it one step behind (its exchange overlaps the next step's compute) and arrives home after
    W hops.
    """
    bsz, n, heads, dim = q.shape
    world = 1 if kv_comm is None else kv_comm.world_size
    p = piece_size(n, q.device)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    shape = (2, bsz, p, heads, dim)
    bufs = [torch.empty(shape, dtype=k.dtype, device=k.device) for _ in "ab"]
    acc = [torch.empty(shape, dtype=torch.float32, device=k.device) for _ in "ab"]
    mine = torch.empty(shape, dtype=torch.float32, device=k.device)  # this step's share
    for j in range(n // p):
        cur = _pack(k[:, j * p : (j + 1) * p], v[:, j * p : (j + 1) * p])
        held = 0  # acc[held]: the accumulator of the piece held now
        for t in range(world):
            if kv_comm is not None and t < world - 1:
                kv_comm.start(cur, bufs[t % 2])
            mine.zero_()
            blocks = _piece_blocks(plan[t], j, p, n)
            add_kv_grads(mine, step_backward(dout, q, cur[0], cur[1], out, lse, blocks, dq, scale))
            if t == 0:
                acc[held].copy_(mine)
            else:
                dkv_comm.wait()  # the held piece's accumulator, from the previous rank
                held = 1 - held
                acc[held].add_(mine)
            if dkv_comm is not None:
                dkv_comm.start(acc[held], acc[1 - held])
            if kv_comm is not None and t < world - 1:
                kv_comm.wait()
                cur = bufs[t % 2]
        if dkv_comm is not None:
            dkv_comm.wait()  # after W hops: my own piece, every rank's share summed
            held = 1 - held
        dk[:, j * p : (j + 1) * p] = acc[held][0]
        dv[:, j * p : (j + 1) * p] = acc[held][1]
    return dq, dk, dv


class RingFunction(torch.autograd.Function):
    """Autograd wrapper of the ring loop: saves (q, k, v, out, lse); backward rings dK/dV home."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale):  # type: ignore[override]
        kv_comm = RingComm(group, KV_TAG) if group is not None else None
        out, lse = ring_forward(q, k, v, plan, kv_comm, scale)
        ctx.plan, ctx.group, ctx.scale = plan, group, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        kv_comm = RingComm(group, KV_TAG) if group is not None else None
        dkv_comm = RingComm(group, DKV_TAG) if group is not None else None
        dq, dk, dv = ring_backward(
            dout.contiguous(), q, k, v, out, lse, ctx.plan, kv_comm, dkv_comm, ctx.scale
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
