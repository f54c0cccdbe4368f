"""`ring_dilated`: LongNet dilated attention over a sequence sharded across ranks.

LongNet's distributed algorithm: a branch (w, r) whose segments fit in a rank's shard (w <= n,
n = seq / W) runs locally with no communication (the single-process `dilated` code on the
shard); a longer segment spans w / n consecutive ranks, which all-gather only that segment's
dilated K/V rows (w / r rows, independent of the total length) in a subgroup of those ranks.
Each rank attends its own dilated query rows to the gathered keys; the backward all-reduces the
segment's dK/dV rows in the same subgroup and keeps its own. Branches merge per (head, position)
through the primitive's log-sum-exp merge, as in `dilated`; the result equals `dilated` on the
full sequence.

The computation runs on contiguous shards, where the segments are: every causal segment costs the
same, so a contiguous split is already balanced and zigzag or striped buy nothing here. Shards
given in zigzag or striped layout (a model sharded for `ring`) are moved to contiguous on entry
and the output back on exit, one P2P all-to-all each way (`relayout`; O(seq / W) per rank).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attention import primitive
from attention.base import Kernel, attention_flops, causal_pairs, check_qkv
from attention.dilated import DilatedParams, check_dilated, dilated_backward, dilated_forward
from attention.hilbert import hilbert_permutation
from attention.layouts import check_layout, check_seq_len
from attention.layouts import positions as layout_positions
from attention.primitive import block_backward, block_forward, merge_
from attention.registry import KernelSpec, register
from attention.ring.comm import check_backend, check_same_call, rank_and_world, resolve_group
from attention.ring.dense import check_group
from attention.ring.relayout import relayout


@dataclass(frozen=True)
class RingDilatedParams(DilatedParams):
    """`dilated`'s parameters plus layout (contiguous | zigzag | striped; None means contiguous,
    causal or not, since contiguous shards are already balanced) and group (a torch.distributed
    process group; None: the world)."""

    layout: str | None = None
    group: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is not None:
            check_layout(self.layout)
        check_group(self.group)

    def twin(self) -> DilatedParams:
        """The single-process `dilated` parameters."""
        return DilatedParams(self.segment_lengths, self.dilation_rates, self.ordering)


def check_ring_dilated(
    params: RingDilatedParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """`dilated`'s rules on the full length, the layout's split, then per contiguous shard of
    n = seq_len / world_size: a segment w <= n must divide n; a longer one must be a multiple of
    n, and n must divide by r."""
    check_dilated(params.twin(), seq_len=seq_len, world_size=1, num_heads=num_heads)
    check_seq_len(seq_len, params.layout or "contiguous", world_size)
    n = seq_len // world_size
    for w, r in zip(params.segment_lengths, params.dilation_rates, strict=True):
        if w <= n and n % w:
            raise ValueError(
                f"seq_len: the shard of {n} tokens (seq_len {seq_len} / world_size {world_size}) "
                f"must divide by segment length {w}"
            )
        if w > n and (w % n or n % r):
            raise ValueError(
                f"seq_len: segment length {w} spans several shards of {n} tokens (seq_len "
                f"{seq_len} / world_size {world_size}); it must be a multiple of {n}, and {n} "
                f"must divide by its dilation rate {r}"
            )


def _head_groups(num_heads: int, rate: int) -> Iterator[tuple[int, int, int]]:
    """(offset g, first head, end head) of each non-empty head group (authors' semantics)."""
    size = math.ceil(num_heads / rate)
    for g in range(rate):
        h0, h1 = g * size, min(num_heads, (g + 1) * size)
        if h0 < h1:
            yield g, h0, h1


@dataclass(frozen=True)
class _Far:
    """A branch whose segments span `span` ranks; this rank is `index` of its subgroup."""

    w: int
    r: int
    span: int
    index: int
    group: Any


def _key_parts(far: _Far, m: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(k0, k1, causal) of the gathered segment rows this rank's m query rows attend to."""
    a = far.index * m  # dilated index of my first row in the segment
    if not causal:
        return [(0, far.span * m, False)]
    return ([(0, a, False)] if a else []) + [(a, a + m, True)]


def _gather(x_rows: list[torch.Tensor], far: _Far) -> torch.Tensor:
    """(2, B, span*m, Hg, D): the segment's dilated K and V rows from every rank of the span."""
    send = torch.stack(x_rows).contiguous()  # (2, B, m, Hg, D)
    parts = [torch.empty_like(send) for _ in range(far.span)]
    dist.all_gather(parts, send, group=far.group)
    return torch.cat(parts, dim=2)


def _far_forward(q, k, v, out, lse, far: _Far, causal: bool, scale: float) -> None:
    r = far.r
    for g, h0, h1 in _head_groups(q.shape[2], r):
        q_rows = q[:, g::r, h0:h1]
        kv = _gather([k[:, g::r, h0:h1], v[:, g::r, h0:h1]], far)
        o_view, l_view = out[:, g::r, h0:h1], lse[:, h0:h1, g::r]
        for k0, k1, cz in _key_parts(far, q_rows.shape[1], causal):
            o_b, l_b = block_forward(
                q_rows, kv[0, :, k0:k1], kv[1, :, k0:k1], scale=scale, causal=cz
            )
            merge_(o_view, l_view, o_b, l_b)


def _far_backward(dout, q, k, v, out, lse, grads, far: _Far, causal: bool, scale: float) -> None:
    dq, dk, dv = grads
    r = far.r
    for g, h0, h1 in _head_groups(q.shape[2], r):
        rows = (slice(None), slice(g, None, r), slice(h0, h1))
        m = q[rows].shape[1]
        kv = _gather([k[rows], v[rows]], far)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for k0, k1, cz in _key_parts(far, m, causal):
            dq_b, dk_b, dv_b = block_backward(
                dout[rows], q[rows], kv[0, :, k0:k1], kv[1, :, k0:k1], out[rows],
                lse[:, h0:h1, g::r], scale=scale, causal=cz,
            )  # fmt: skip
            dq[rows] += dq_b
            dkv[0, :, k0:k1] += dk_b
            dkv[1, :, k0:k1] += dv_b
        dist.all_reduce(dkv, group=far.group)  # every rank's share of the segment's keys
        a = far.index * m
        dk[rows] += dkv[0, :, a : a + m]
        dv[rows] += dkv[1, :, a : a + m]


def _local_params(params: RingDilatedParams, n: int) -> DilatedParams | None:
    branches = zip(params.segment_lengths, params.dilation_rates, strict=True)
    pairs = [(w, r) for w, r in branches if w <= n]
    if not pairs:
        return None
    ws, rs = zip(*pairs, strict=True)
    return DilatedParams(tuple(ws), tuple(rs))


class _RingDilatedFunction(torch.autograd.Function):
    """Local branches through `dilated`'s code, far ones by subgroup gathers; FA2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, local, fars, causal):  # type: ignore[override]
        scale = q.shape[-1] ** -0.5
        if local is not None:
            out, lse = dilated_forward(q, k, v, local, causal)
        else:
            out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        for far in fars:
            _far_forward(q, k, v, out, lse, far, causal, scale)
        ctx.local, ctx.fars, ctx.causal = local, fars, causal
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        scale = q.shape[-1] ** -0.5
        if ctx.local is not None:
            grads = dilated_backward(dout, q, k, v, out, lse, ctx.local, ctx.causal)
        else:
            grads = tuple(
                torch.zeros(q.shape, dtype=torch.float32, device=q.device) for _ in range(3)
            )
        for far in ctx.fars:
            _far_backward(dout, q, k, v, out, lse, grads, far, ctx.causal, scale)
        dq, dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class RingDilatedAttention(Kernel):
    """Dilated attention on this rank's shard: `module(q, k, v, *, causal=False)`.

    Under ordering='hilbert' a rank holds its shard of the Hilbert-ordered sequence (see
    `local_positions`) and its output comes back in that order.
    """

    def __init__(self, params: RingDilatedParams | None = None) -> None:
        super().__init__()
        self.params = params or RingDilatedParams()
        self.layout = self.params.layout or "contiguous"
        self._subgroups: dict[tuple[int, int], Any] = {}

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Global (natural) positions of the tokens rank `rank` must pass, in its local order.

        `causal` is taken for the ring kernels' common signature; this kernel's default layout
        is contiguous whether causal or not.
        """
        pos = layout_positions(seq_len, self.layout, rank, world_size)
        if self.params.ordering == "hilbert":
            return hilbert_permutation(seq_len)[pos]
        return pos

    def _subgroup(self, group: Any, rank: int, world: int, span: int) -> Any:
        """The process group of the `span` consecutive ranks sharing this rank's segment."""
        if span == world:
            return group
        key = (id(group), span)
        if key not in self._subgroups:
            first = rank - rank % span
            members = [dist.get_global_rank(group, first + i) for i in range(span)]
            self._subgroups[key] = dist.new_group(members, use_local_synchronization=True)
        return self._subgroups[key]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        group = resolve_group(self.params.group)
        check_backend(group, q.device)
        check_same_call(group, q, causal, self.params, local_check=lambda: check_qkv(q, k, v))
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n = q.shape[1]
        check_ring_dilated(self.params, seq_len=n * world, world_size=world, num_heads=q.shape[2])
        self.backend = primitive.backend_for(q.device, q.dtype)
        fars = []
        for w, r in zip(self.params.segment_lengths, self.params.dilation_rates, strict=True):
            if w > n:
                span = w // n
                sub = self._subgroup(group, rank, world, span)
                fars.append(_Far(w, r, span, rank % span, sub))
        local = _local_params(self.params, n)
        if self.layout == "contiguous" or world == 1:
            q, k, v = (t.contiguous() for t in (q, k, v))
            return _RingDilatedFunction.apply(q, k, v, local, tuple(fars), causal)
        qkv = relayout(torch.stack((q, k, v), dim=2), self.layout, "contiguous", group)
        q, k, v = (t.contiguous() for t in qkv.unbind(2))
        out = _RingDilatedFunction.apply(q, k, v, local, tuple(fars), causal)
        return relayout(out, "contiguous", self.layout, group)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """FLOPs of this rank for a local shard of `seq_len` tokens: its query rows' pairs."""
        rank, _ = rank_and_world(self.params.group)
        n, pairs = seq_len, 0
        for w, r in zip(self.params.segment_lengths, self.params.dilation_rates, strict=True):
            m = w // r
            if w <= n:
                pairs += (n // w) * (causal_pairs(m) if causal else m * m)
            else:
                mine = n // r
                a = (rank % (w // n)) * mine
                pairs += a * mine + causal_pairs(mine) if causal else mine * m
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)


register(
    KernelSpec(
        name="ring_dilated",
        description=(
            "LongNet dilated attention across ranks: segments inside a shard run locally, "
            "longer ones all-gather only their dilated K/V rows among the ranks they span; "
            "zigzag or striped shards are moved to contiguous and back."
        ),
        params=RingDilatedParams,
        factory=RingDilatedAttention,
        distributed=True,
        check=check_ring_dilated,
    )
)
