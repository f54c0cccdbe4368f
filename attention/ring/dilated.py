"""`ring_dilated`: LongNet dilated attention over a sequence sharded across ranks.

LongNet's distributed algorithm, on contiguous shards of n = seq / W tokens: a segment of a
branch (w, r) that lies inside one shard runs locally with no communication (`dilated`'s code on
that range of the shard); a segment that spans several shards (w > n, a segment that straddles
a shard boundary when n is not a multiple of w, or one longer than the sequence) gathers only
its dilated K/V rows (about w / r rows per head group, independent of the total length) from
the ranks it spans, by P2P exchanges among them. Each rank attends its own dilated query rows
of the segment to the gathered keys; the backward sends each rank's share of the segment's
dK/dV rows to the rank that holds them, which sums them. Ranks may hold different numbers of a
group's rows (r need not divide n): every rank knows every count. Branches merge per (head,
position) through the primitive's log-sum-exp merge, as in `dilated`, whose conventions
(segments that do not divide, no padding attended) hold here: the result equals `dilated` on
the full sequence.

The computation runs on contiguous shards, where the segments are: every causal segment costs the
same, so a contiguous split is already balanced and zigzag or striped buy nothing here. Shards
given in zigzag or striped layout (a model sharded for `ring`) are moved to contiguous on entry
and the output back on exit, one P2P all-to-all each way (`relayout`; O(seq / W) per rank).
K/V may have fewer heads than q (grouped-query attention); gathers move only the kv heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from attention import dilated_plan, primitive
from attention.autograd import merged_attention
from attention.dilated import (
    DilatedParams,
    backward_rows,
    check_dilated,
    forward_rows,
)
from attention.hilbert import hilbert_permutation
from attention.layouts import check_seq_len
from attention.layouts import positions as layout_positions
from attention.plans import resolve_plan
from attention.primitive import (
    accumulator_dtype,
    block_backward,
    block_forward,
    empty_result,
    merge_,
    zero_grads,
)
from attention.registry import BenchParams, register
from attention.ring.comm import (
    Tag,
    exchange,
)
from attention.ring.needed import offset_kept
from attention.ring.relayout import relayout, routes
from attention.ring.sharded import HeadShape, ShardedKernel, check_placement, sharded_spec
from attention.ring.steps import clock
from attention.segments import branch_rows, group_bounds, offset_rows


@dataclass(frozen=True)
class RingDilatedParams(DilatedParams):
    """`dilated`'s parameters plus layout (contiguous | zigzag | striped; None means contiguous,
    causal or not, since contiguous shards are already balanced) and group (a torch.distributed
    process group; None: the world)."""

    layout: str | None = None
    group: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_placement(self.layout, self.group)

    def twin(self) -> DilatedParams:
        """The single-process `dilated` parameters (its plan included)."""
        return DilatedParams(self.segment_lengths, self.dilation_rates, self.ordering, self.plan)


def check_ring_dilated(
    params: RingDilatedParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """`dilated`'s rules on the full length and the layout's split (any segment lengths: those
    that span shards are gathered)."""
    check_dilated(params.twin(), seq_len=seq_len, world_size=1, num_heads=num_heads)
    check_seq_len(seq_len, params.layout or "contiguous", world_size)


@dataclass(frozen=True)
class Far:
    """Segment [a, b) (global positions) of a branch of rate r, spanning ranks first..last of
    contiguous shards of n tokens; `group`: the ring's process group."""

    a: int
    b: int
    r: int
    n: int
    first: int
    last: int
    group: Any = None

    def rows(self, member: int, g: int) -> tuple[int, int]:
        """(first position, count) of offset g's rows of this segment on rank `member`."""
        lo, hi = max(self.a, member * self.n), min(self.b, (member + 1) * self.n)
        start = self.a + g + max(0, -(-(lo - self.a - g) // self.r)) * self.r
        return start, offset_rows(hi - start, 0, self.r) if start < hi else 0

    def counts(self, g: int) -> list[int]:
        """Rows of offset g on each rank of the span, in rank order."""
        return [self.rows(m, g)[1] for m in range(self.first, self.last + 1)]


def plan_branch(w: int, seq_len: int, rank: int, n: int) -> tuple[tuple[int, int] | None, list]:
    """For rank `rank`'s shard [rank n, (rank + 1) n): the local range [lo, hi) (shard
    positions) of the segments it holds whole, or None, and the segments (a, b) it shares."""
    r0, r1 = rank * n, (rank + 1) * n
    segments = [(j, min(j + w, seq_len)) for j in range((r0 // w) * w, r1, w)]
    inside = [(a, b) for a, b in segments if a >= r0 and b <= r1]
    shared = [(a, b) for a, b in segments if (a, b) not in inside]
    local = (inside[0][0] - r0, inside[-1][1] - r0) if inside else None
    return local, shared


def _kv_range(h0: int, h1: int, heads: int, kv_heads: int) -> tuple[int, int]:
    group = heads // kv_heads
    return h0 // group, (h1 - 1) // group + 1


def _sel(start: int, m: int, r: int) -> slice:
    """Positions start, start + r, ... (m of them) as a slice."""
    return slice(start, start + (m - 1) * r + 1, r) if m else slice(start, start)


def _gather(
    x: torch.Tensor, y: torch.Tensor, far: Far, rank: int, counts: list[int]
) -> torch.Tensor:
    """(2, B, sum(counts), Hkv, D): the segment's rows of x and y (this rank's: (B, m, Hkv, D))
    from every rank of the span, in position order."""
    send = torch.stack((x, y)).contiguous()
    span = range(far.first, far.last + 1)
    parts = {
        j: send.new_empty((2, x.shape[0], c, *x.shape[2:]))
        for j, c in zip(span, counts, strict=True)
        if j != rank
    }
    exchange(far.group, {j: send for j in parts}, parts, Tag.SEGMENT_GATHER)
    return torch.cat([send if j == rank else parts[j] for j in span], dim=2)


def _reduce_home(dkv: torch.Tensor, far: Far, rank: int, counts: list[int]) -> torch.Tensor:
    """This rank's rows of the segment's dK/dV (2, B, m, Hkv, D), summed over the span's ranks
    (each rank computed a share of every row's gradient)."""
    span = range(far.first, far.last + 1)
    offsets = dict(zip(span, [sum(counts[:i]) for i in range(len(counts))], strict=True))
    mine = dict(zip(span, counts, strict=True))[rank]
    own = dkv[:, :, offsets[rank] : offsets[rank] + mine]
    sends = {
        j: dkv[:, :, offsets[j] : offsets[j] + c].contiguous()
        for j, c in zip(span, counts, strict=True)
        if j != rank
    }
    recvs = {j: torch.empty_like(own) for j in sends}
    exchange(far.group, sends, recvs, Tag.SEGMENT_REDUCE)
    return own + sum(recvs.values()) if recvs else own


def _key_parts(before: int, m: int, total: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(k0, k1, causal) of the gathered rows that this rank's m rows, `before` rows into the
    segment, attend to."""
    if not causal:
        return [(0, total, False)]
    return ([(0, before, False)] if before else []) + [(before, before + m, True)]


def _far_groups(far: Far, rank: int, heads: int, kv_heads: int):
    """Per head group: (g, h0, h1, kv range, my local row selector, my count, rows before me,
    all counts)."""
    for g, h0, h1 in group_bounds(heads, far.r):
        counts = far.counts(g)
        start, m = far.rows(rank, g)
        before = sum(counts[: rank - far.first])
        sel = _sel(start - rank * far.n, m, far.r)
        yield g, h0, h1, _kv_range(h0, h1, heads, kv_heads), sel, m, before, counts


def _far_forward(q, k, v, out, lse, far: Far, rank: int, causal: bool) -> None:
    heads, kv_heads, scale = q.shape[2], k.shape[2], q.shape[-1] ** -0.5
    for _, h0, h1, (c0, c1), sel, m, before, counts in _far_groups(far, rank, heads, kv_heads):
        kv = _gather(k[:, sel, c0:c1], v[:, sel, c0:c1], far, rank, counts)
        if not m:
            continue
        for a0, a1, k0, k1 in primitive.kv_head_pieces(h0, h1, heads, kv_heads):
            o_view, l_view = out[:, sel, a0:a1], lse[:, a0:a1, sel]
            for s0, s1, cz in _key_parts(before, m, sum(counts), causal):
                keys = kv[:, :, s0:s1, k0 - c0 : k1 - c0]
                o_b, l_b = block_forward(q[:, sel, a0:a1], keys[0], keys[1], scale=scale, causal=cz)
                merge_(o_view, l_view, o_b, l_b)


def _far_backward(dout, q, k, v, out, lse, grads, far: Far, rank: int, causal: bool) -> None:
    dq, dk, dv = grads
    heads, kv_heads, scale = q.shape[2], k.shape[2], q.shape[-1] ** -0.5
    for _, h0, h1, (c0, c1), sel, m, before, counts in _far_groups(far, rank, heads, kv_heads):
        kv = _gather(k[:, sel, c0:c1], v[:, sel, c0:c1], far, rank, counts)
        dkv = torch.zeros(kv.shape, dtype=accumulator_dtype(q.dtype), device=kv.device)
        for a0, a1, k0, k1 in primitive.kv_head_pieces(h0, h1, heads, kv_heads):
            rows = (slice(None), sel, slice(a0, a1))
            for s0, s1, cz in _key_parts(before, m, sum(counts), causal) if m else []:
                keys = kv[:, :, s0:s1, k0 - c0 : k1 - c0]
                dq_b, dk_b, dv_b = block_backward(
                    dout[rows], q[rows], keys[0], keys[1], out[rows], lse[:, a0:a1, sel],
                    scale=scale, causal=cz,
                )  # fmt: skip
                dq[rows] += dq_b
                dkv[0, :, s0:s1, k0 - c0 : k1 - c0] += dk_b
                dkv[1, :, s0:s1, k0 - c0 : k1 - c0] += dv_b
        home = _reduce_home(dkv, far, rank, counts)
        dk[:, sel, c0:c1] += home[0]
        dv[:, sel, c0:c1] += home[1]


def _plan(
    params: DilatedParams, seq_len: int, rank: int, n: int
) -> tuple[list[tuple[int, int, int, int]], list[Far]]:
    """This rank's local spans (w, r, lo, hi) for `dilated`'s row code and its shared segments
    (branches by increasing rate, segments by position: the same order on every rank)."""
    spans, fars = [], []
    for w, r in params.branches():
        local, shared = plan_branch(w, seq_len, rank, n)
        if local is not None:
            spans.append((w, r, *local))
        fars += [Far(a, b, r, n, a // n, (b - 1) // n) for a, b in shared]
    return spans, fars


def _span_groups(
    spans: list[tuple[int, int, int, int]],
) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """The local spans as (lo, hi, branches): the branches over one range of positions, in the
    spans' order (the cuda plan runs a range's branches together)."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for w, r, lo, hi in spans:
        groups.setdefault((lo, hi), []).append((w, r))
    return [(lo, hi, tuple(branches)) for (lo, hi), branches in groups.items()]


def _dense_rows(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """x[:, lo:hi] (B, S, ...), copied when B > 1 and the slice is not the whole sequence:
    `dilated_plan` folds batch rows into its calls and needs (B, S, ...)-dense tensors."""
    part = x[:, lo:hi]
    return part if x.shape[0] == 1 or (lo, hi) == (0, x.shape[1]) else part.contiguous()


def _cuda_local_forward(q, k, v, out, lse, spans, causal: bool) -> None:  # type: ignore[no-untyped-def]
    """The local spans by `dilated`'s cuda plan (one fused call per branch and head group of
    each range), merged into the (out, lse) accumulators (empty_result's) by lse."""
    for lo, hi, branches in _span_groups(spans):
        qs, ks, vs = (_dense_rows(t, lo, hi) for t in (q, k, v))
        o_s, l_s = dilated_plan.forward(qs, ks, vs, branches, causal)
        merge_(out[:, lo:hi], lse[:, :, lo:hi], o_s, l_s)
        del o_s, l_s


def _cuda_local_backward(dout, q, k, v, out, lse, grads, spans, causal: bool) -> None:  # type: ignore[no-untyped-def]
    """The local spans' gradients by `dilated`'s cuda plan, fed the final merged (out, lse)."""
    for lo, hi, branches in _span_groups(spans):
        d_s, q_s, k_s, v_s, o_s = (_dense_rows(t, lo, hi) for t in (dout, q, k, v, out))
        l_s = lse[:, :, lo:hi].transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H) dense
        parts = dilated_plan.backward(d_s, q_s, k_s, v_s, o_s, l_s, branches, causal)
        for grad, part in zip(grads, parts, strict=True):
            grad[:, lo:hi] += part
        del parts


def _ring_dilated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    fars: tuple[Far, ...],
    rank: int,
    causal: bool,
    cuda: bool = False,
) -> torch.Tensor:
    """Local spans through `dilated`'s code (`cuda`: its cuda plan, dilated_plan), shared
    segments by P2P gathers; FA2 backward (attention.autograd.MergedFunction). With no shared
    segment (W = 1, or every segment local) the cpu plan's output is finished in accumulator
    windows as `dilated`'s is (in q's dtype); otherwise, and under the cuda plan, it stays fp32
    until every span and far segment has merged into every row."""

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not cuda and not fars:

            def fill(c0: int, c1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
                forward_rows(q, k, v, out, lse, spans, causal, window=(c0, c1))

            with clock.step("forward", 0):
                return primitive.windowed_result(q, fill, primitive.windows(q.shape[1], q.dtype))
        local_forward = _cuda_local_forward if cuda else forward_rows
        out, lse = empty_result(q)
        with clock.step("forward", 0):
            local_forward(q, k, v, out, lse, spans, causal)
        for i, far in enumerate(fars, 1):
            with clock.step("forward", i):
                _far_forward(q, k, v, out, lse, far, rank, causal)
        return out, lse

    def backward(dout, q, k, v, out, lse):  # type: ignore[no-untyped-def]
        grads = zero_grads(q, k)
        with clock.step("backward", 0):
            if cuda:
                _cuda_local_backward(dout, q, k, v, out, lse, grads, spans, causal)
            else:
                backward_rows(dout, q, k, v, out, lse, grads, spans, causal)
        for i, far in enumerate(fars, 1):
            with clock.step("backward", i):
                _far_backward(dout, q, k, v, out, lse, grads, far, rank, causal)
        return grads

    return merged_attention(q, k, v, forward, backward)  # type: ignore[arg-type]


class RingDilatedAttention(ShardedKernel):
    """Dilated attention on this rank's shard: `module(q, k, v, *, causal=False)`.

    Under ordering='hilbert' a rank holds its shard of the Hilbert-ordered sequence (see
    `local_positions`) and its output comes back in that order.
    """

    def __init__(self, params: RingDilatedParams | None = None) -> None:
        super().__init__(params or RingDilatedParams())
        self.layout = self.params.layout or "contiguous"

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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        group, rank, world = self.join(q, k, v, causal)
        n = q.shape[1]
        check_ring_dilated(self.params, seq_len=n * world, world_size=world, num_heads=q.shape[2])
        plan = resolve_plan(self.params.plan, q.device)
        self.plan = plan
        self.backend = f"{primitive.backend_for(q.device, q.dtype)}/plan-{plan}"
        spans, fars = _plan(self.params, n * world, rank, n)
        far_group = tuple(dataclasses.replace(f, group=group) for f in fars)
        args = (spans, far_group, rank, causal, plan == "cuda")
        if self.layout == "contiguous" or world == 1:
            q, k, v = (t.contiguous() for t in (q, k, v))
            return _ring_dilated(q, k, v, *args)
        if k.shape[2] != q.shape[2]:
            qkv = [relayout(t, self.layout, "contiguous", group) for t in (q, k, v)]
        else:
            qkv = list(relayout(torch.stack((q, k, v), dim=2), self.layout, "contiguous", group)
                       .unbind(2))  # fmt: skip
        q, k, v = (t.contiguous() for t in qkv)
        out = _ring_dilated(q, k, v, *args)
        return relayout(out, "contiguous", self.layout, group)

    def rank_pairs(self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int) -> int:
        """The pairs of this rank's query rows: its local spans' and its far segments'."""
        spans, fars = _plan(self.params, seq_len * world, rank, seq_len)
        pairs = 0
        for w, r, lo, hi in spans:
            rows = branch_rows(lo, hi, w, r, num_heads, chunk_tokens=seq_len)
            pairs += sum((x.h1 - x.h0) * x.pairs(causal) for x in rows)
        for far in fars:
            for g, h0, h1 in group_bounds(num_heads, far.r):
                counts, m = far.counts(g), far.rows(rank, g)[1]
                before = sum(counts[: rank - far.first])
                mine = before * m + m * (m + 1) // 2 if causal else m * sum(counts)
                pairs += (h1 - h0) * mine
        return pairs

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """The relayout's K/V rows (zigzag or striped shards: the tokens of this rank's
        contiguous shard held elsewhere, all kv heads), wasted where no head's offset group
        attends them (needed.offset_kept); and each shared segment's gather of a head group's
        dilated rows from the other ranks of its span, for that group's kv heads: all wasted
        when this rank holds none of the group's rows, the later ranks' when causal."""
        received = wasted = 0
        if self.layout != "contiguous" and world > 1:
            _, recv = routes(seq_len * world, self.layout, "contiguous", rank, world)
            kept = offset_kept(self.params.branches(), seq_len * world, heads.num_heads)
            row = heads.row(heads.kv_heads)
            for peer, rows in enumerate(recv):
                if peer != rank:
                    received += rows.numel() * row
                    wasted += int((~kept[rank * seq_len + rows]).sum()) * row
        for far in _plan(self.params, seq_len * world, rank, seq_len)[1]:
            mine = rank - far.first
            for g, h0, h1 in group_bounds(heads.num_heads, far.r):
                c0, c1 = _kv_range(h0, h1, heads.num_heads, heads.kv_heads)
                counts = far.counts(g)
                others = sum(counts) - counts[mine]
                unused = others if not counts[mine] else sum(counts[mine + 1 :]) if causal else 0
                received += others * heads.row(c1 - c0)
                wasted += unused * heads.row(c1 - c0)
        return received, wasted


def contiguous_layout(layout: str | None, causal: bool) -> str:
    """ring_dilated's layout: the one given, else contiguous (causal or not: its segments are
    local to contiguous shards)."""
    return layout or "contiguous"


register(
    sharded_spec(
        "ring_dilated",
        "LongNet dilated attention across ranks: segments inside a shard run locally, "
        "longer ones all-gather only their dilated K/V rows among the ranks they span; "
        "zigzag or striped shards are moved to contiguous and back.",
        RingDilatedParams,
        RingDilatedAttention,
        check_ring_dilated,
        twin="dilated",
        default_layout=contiguous_layout,
        device_plan=True,
        bench_params=BenchParams(gpu={}),
    )
)
