"""`dilated`: LongNet dilated attention (Ding et al. 2023) with the authors' head/offset semantics.

Branch i = (w_i, r_i): the sequence is cut into segments of w_i tokens; the heads are split into
r_i contiguous groups of ceil(H / r_i) heads; group g keeps, in every segment, the positions p
(counted from the segment start) with p % r_i == g, and those attend among themselves (causal on
the original positions when causal). Every head takes part in every branch. Branches are mixed
per (head, position) by softmax over their log-sum-exps (paper Eq. 10) through the primitive's
merge; a branch that does not cover a (head, position) has no weight there, and a (head,
position) no branch covers outputs 0 (possible when r_i > 1 in every branch).

Any segment length, rate and sequence length are accepted (the paper's w = 2048..32768 with
r = 1, 2, 4, 6, 12 included). Convention where they do not divide, padding never attended:
- a segment length not divisible by its rate: the offsets g < w % r keep one row more per
  segment than the others (positions g, g + r, ... inside the segment);
- a sequence that is not a multiple of w: the last segment is shorter (the remaining tokens);
- a segment longer than the sequence: the whole sequence is one segment.
The authors' code (torchscale, component/dilated_attention.py) reaches the same shapes by zero
padding (each segment to a multiple of r, the sequence to a multiple of w; a segment longer than
the sequence is shrunk to it). Causally its padding is never seen (it comes last), so both
agree; non-causally its queries also attend the zero keys of the padding, which adds exp(0)
terms to their softmax denominators. We differ there on purpose: a token's output would depend
on how far its length is from the next multiple of w, and a sequence would not equal the same
tokens with padding that the user added and masked. Where every w divides the sequence and
every r divides its w, the two are identical (reference.md: ~1e-6).

Two plans cut this work into fused calls (`params.plan`: auto | cpu | cuda; auto by the
inputs' device type), with the same semantics and the same correctness tests: the cpu plan
(this module, below) bounds every call to keep the CPU op's buffers and our temporaries small;
the cuda plan (`attention.dilated_plan`) folds the segments into the batch and makes one fused
call per branch and head group, since a GPU is host-bound on thousands of small calls
(`python -m bench.plan` counts both). The plan that ran ends the kernel's `backend`
("cpu_flash/plan-cpu").

The cpu plan: the dilated rows of a group are strided views of q/k/v (no copies,
`attention.segments`); each call of the primitive takes a chunk of segments, so temporaries
stay a fraction of the inputs.
Inputs narrower than fp32 (bf16, fp16) are finished in accumulator windows of positions
(primitive.windowed_result): a segment a window cuts runs its queries inside the window
against all its keys, so the fp32 rows held are one window's, not the whole output's.
The backward recomputes every branch with the final merged (out, lse) (FlashAttention-2), since
the fused lse has no grad; it cuts a segment's rows into query and key parts (backward_parts),
so that its temporaries plus the op's own buffers stay below dense's (measured: train peak
1.02x dense's at 16K with whole segments, 1.00x with parts; ring_dilated's segments shared
across ranks still go whole). k and v may have fewer heads than q (grouped-query attention).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from attention import dilated_plan, primitive
from attention.autograd import merged_attention
from attention.base import MergedKernel, attention_flops, check_qkv
from attention.errors import ParamError
from attention.hilbert import check_hilbert_length, check_ordering, in_order
from attention.masks import dilated_branch_mask
from attention.plans import check_plan, resolve_plan
from attention.primitive import block_backward, block_forward, merge_, zero_grads
from attention.registry import BenchParams, Exact, KernelSpec, register
from attention.segments import Rows, branch_pairs, branch_rows, window_parts

CHUNK_TOKENS = 2048
"""Tokens of one batch row per primitive call (whole segments, at least one)."""
CALL_ROW_HEADS = 2048
"""Bound on rows x heads of one forward call (heads split further when a segment's rows are
many): its block output is a temporary of that size, on top of the op's buffers that dense
pays too (with 4096, dilated's maximum length under 64 MiB was one step below dense's:
31,232 against 31,744 tokens)."""
BACKWARD_QUERY_TOKENS = 512
"""Bound on a segment's query rows per backward call: the CPU flash op's backward takes a
buffer of 1 MiB per thread from 768 queries, 256 KiB below (FlashAttentionKernel.cpp)."""
BACKWARD_KEY_TOKENS = 768
"""Bound on a segment's key rows per backward call: its dk and dv are temporaries, and the op
accumulates them for every query tile (at 2048 keys it ran ~1.4x slower here, a cache's worth)."""
BACKWARD_ROW_HEADS = 5120
"""Bound on rows x heads of one backward call's temporaries: per query row its dq and the op's
contiguous copy of dout, per key row its dk and dv (segments and heads are split to stay
within it, down to one segment and head). The CPU op runs batch x heads in parallel (one per
thread), so this fits two heads of the largest parts."""


def _int_tuple(field: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int | str) or not hasattr(value, "__iter__"):
        raise ParamError(f"params.{field}", f"expected a list of positive integers, got {value!r}")
    items = tuple(value)
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ParamError(f"params.{field}", f"expected positive integers, got {list(items)}")
    return items


@dataclass(frozen=True)
class DilatedParams:
    """segment_lengths w_i and dilation_rates r_i (one rate per length, any values: see the
    module docstring for lengths that do not divide); token ordering."""

    segment_lengths: tuple[int, ...] = (2048, 4096, 8192)
    dilation_rates: tuple[int, ...] = (1, 2, 4)
    ordering: str = "natural"
    plan: str = "auto"

    def __post_init__(self) -> None:
        w = _int_tuple("segment_lengths", self.segment_lengths)
        r = _int_tuple("dilation_rates", self.dilation_rates)
        object.__setattr__(self, "segment_lengths", w)
        object.__setattr__(self, "dilation_rates", r)
        if not w:
            raise ParamError("params.segment_lengths", "must not be empty")
        if len(w) != len(r):
            raise ParamError(
                "params.dilation_rates",
                f"must have one rate per segment length, got {len(r)} "
                f"rates for {len(w)} segment lengths",
            )
        check_ordering(self.ordering)
        check_plan(self.plan)

    def branches(self) -> list[tuple[int, int]]:
        """(w, r) pairs by increasing rate: the first (widest coverage) is copied, the rest
        merged."""
        pairs = zip(self.segment_lengths, self.dilation_rates, strict=True)
        return sorted(pairs, key=lambda p: p[1])


def check_dilated(
    params: DilatedParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Raise ValueError unless seq_len is a power of 4 under hilbert ordering (any length and
    segment length is accepted otherwise)."""
    if params.ordering == "hilbert":
        check_hilbert_length(seq_len)


def calls(
    rows: Rows, batch: int, num_heads: int, num_kv_heads: int, row_heads: int, row_cost: int
) -> list[tuple[int, Rows, Rows]]:
    """(batch row, query rows, kv rows) of each primitive call for `rows`: one per batch row and
    GQA piece of its heads (query heads reading one kv head run together), as many heads as keep
    rows.count * row_cost * heads within `row_heads` (at least one); `row_cost` is what one
    segment of one head costs (forward: its m rows)."""
    max_heads = max(1, row_heads // (rows.count * row_cost))
    pieces = primitive.kv_head_pieces(rows.h0, rows.h1, num_heads, num_kv_heads, max_heads)
    return [
        (b, dataclasses.replace(rows, h0=a0, h1=a1), dataclasses.replace(rows, h0=k0, h1=k1))
        for b in range(batch)
        for a0, a1, k0, k1 in pieces
    ]


def forward_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    causal: bool,
    window: tuple[int, int] | None = None,
) -> None:
    """Branches (w, r) over positions [lo, hi) (segments from lo), given as (w, r, lo, hi), into
    (out, lse): the first is copied (it must be the first to touch these rows), the rest merged.
    `window` (c0, c1): only the queries at positions [c0, c1), into (out, lse) of those rows
    (row c0 is their row 0; see primitive.windowed_result); None: every query, out and lse of
    the whole sequence."""
    bsz, _, heads, dim = q.shape
    c0, c1 = window or (0, q.shape[1])
    for index, (w, r, lo, hi) in enumerate(spans):
        for rows in branch_rows(lo, hi, w, r, heads, chunk_tokens=CHUNK_TOKENS):
            for q_rows, k_rows, i0 in window_parts(rows, c0, c1):
                for b, qr, kr in calls(q_rows, bsz, heads, k.shape[2], CALL_ROW_HEADS, rows.m):
                    kr = dataclasses.replace(k_rows, h0=kr.h0, h1=kr.h1)
                    o_b, l_b = block_forward(
                        qr.of(q, b), kr.of(k, b), kr.of(v, b),
                        scale=dim**-0.5, causal=causal, diagonal=i0 if causal else 0,
                    )  # fmt: skip
                    at = dataclasses.replace(qr, start=qr.start - c0)
                    o_view, l_view = at.of(out, b), at.of_lse(lse, b)
                    if index == 0:  # the first branch covers each (head, position) at most once
                        o_view.copy_(o_b)
                        l_view.copy_(l_b)
                    else:
                        merge_(o_view, l_view, o_b, l_b)
                    del o_b, l_b


def backward_rows(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    spans: list[tuple[int, int, int, int]],
    causal: bool,
) -> None:
    """Add the block backward of every (w, r, lo, hi) of `spans` (see forward_rows), with the
    merged (out, lse), to grads (dq, dk, dv)."""
    bsz, _, heads, _ = q.shape
    saved = (dout, q, k, v, out, lse)
    for w, r, lo, hi in spans:
        for rows in branch_rows(lo, hi, w, r, heads, chunk_tokens=CHUNK_TOKENS):
            parts = backward_parts(rows.m, causal)
            widest = max(2 * (q1 - q0) + 2 * (k1 - k0) for q0, q1, k0, k1 in parts)
            per_call = max(1, BACKWARD_ROW_HEADS // widest)  # segments of one head
            for s0 in range(0, rows.count, per_call):
                segs = dataclasses.replace(
                    rows, start=rows.start + s0 * rows.stride, count=min(per_call, rows.count - s0)
                )
                for b, qr, kr in calls(segs, bsz, heads, k.shape[2], BACKWARD_ROW_HEADS, widest):
                    _backward_parts_into(saved, grads, b, qr, kr, parts, causal)


def _backward_parts_into(
    saved: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, ...],
    b: int,
    qr: Rows,
    kr: Rows,
    parts: list[tuple[int, int, int, int]],
    causal: bool,
) -> None:
    """One call's rows (qr, kr of batch row b) by backward_parts, added to grads; `saved`:
    backward_rows' (dout, q, k, v, out, lse)."""
    dout, q, k, v, out, lse = saved
    dim = q.shape[3]
    dq, dk, dv = grads
    for q0, q1, k0, k1 in parts:
        qs, ks = slice(q0, q1), slice(k0, k1)
        dq_b, dk_b, dv_b = block_backward(
            qr.of(dout, b)[:, qs], qr.of(q, b)[:, qs], kr.of(k, b)[:, ks],
            kr.of(v, b)[:, ks], qr.of(out, b)[:, qs], qr.of_lse(lse, b)[..., qs],
            scale=dim**-0.5, causal=causal, diagonal=q0 - k0 if causal else 0,
        )  # fmt: skip
        qr.of(dq, b)[:, qs].add_(dq_b)
        kr.of(dk, b)[:, ks].add_(dk_b)
        kr.of(dv, b)[:, ks].add_(dv_b)
        del dq_b, dk_b, dv_b  # before the next call allocates its own


def backward_parts(m: int, causal: bool) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) of the backward calls over one segment's m dilated rows: queries and
    keys in near-equal parts of at most BACKWARD_QUERY_TOKENS and BACKWARD_KEY_TOKENS rows.
    Every part sees the final merged (out, lse), so the parts' gradients add up to the whole
    call's; causal: a key part no query of the query part sees is left out, the rest keep the
    rows' own diagonal (query q0 + i sees key k0 + j when j <= i + q0 - k0)."""
    return [
        (q0, q1, k0, k1)
        for q0, q1 in primitive.token_chunks(0, m, BACKWARD_QUERY_TOKENS)
        for k0, k1 in primitive.token_chunks(0, m, BACKWARD_KEY_TOKENS)
        if not causal or k0 < q1
    ]


def dilated_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: DilatedParams, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out (B,S,H,D) in q's dtype, lse (B,H,S) in the accumulator dtype) of all
    branches, finished window by window (primitive.windowed_result); no graph."""
    spans = _whole(params, q.shape[1])

    def fill(c0: int, c1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        forward_rows(q, k, v, out, lse, spans, causal, window=(c0, c1))

    return primitive.windowed_result(q, fill, primitive.windows(q.shape[1], q.dtype))


def dilated_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: DilatedParams,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the accumulator dtype: every branch's block backward with the final
    merged (out, lse)."""
    grads = zero_grads(q, k)
    backward_rows(dout, q, k, v, out, lse, grads, _whole(params, q.shape[1]), causal)
    return grads  # type: ignore[return-value]


def _whole(params: DilatedParams, seq_len: int) -> list[tuple[int, int, int, int]]:
    return [(w, r, 0, seq_len) for w, r in params.branches()]


class DilatedAttention(MergedKernel):
    """LongNet dilated attention over (B, S, H, D); see the module docstring for the semantics."""

    chunk_tokens = CHUNK_TOKENS

    def __init__(self, params: DilatedParams | None = None) -> None:
        super().__init__()
        self.params = params or DilatedParams()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        check_dilated(self.params, seq_len=q.shape[1], num_heads=q.shape[2])
        plan = resolve_plan(self.params.plan, q.device)
        self.plan = plan
        self.backend = f"{primitive.backend_for(q.device, q.dtype)}/plan-{plan}"
        if plan == "cuda":
            branches = tuple(self.params.branches())
            fwd = functools.partial(dilated_plan.forward, branches=branches, causal=causal)
            bwd = functools.partial(dilated_plan.backward, branches=branches, causal=causal)
        else:
            fwd = functools.partial(dilated_forward, params=self.params, causal=causal)
            bwd = functools.partial(dilated_backward, params=self.params, causal=causal)
        return in_order(
            self.params.ordering, lambda q, k, v: merged_attention(q, k, v, fwd, bwd), q, k, v
        )

    def token_masks(self, seq_len: int, num_heads: int, *, causal: bool = False) -> torch.Tensor:
        """Keep-masks (branches, H, S, S) on the (permuted, under hilbert) positions."""
        branches = zip(self.params.segment_lengths, self.params.dilation_rates, strict=True)
        masks = [dilated_branch_mask(seq_len, num_heads, w, r, causal=causal) for w, r in branches]
        return torch.stack(masks)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """Each head computes, per branch, the pairs of its group's dilated rows in every
        segment (causal: the triangle); see `attention.segments`."""
        pairs = sum(
            branch_pairs(seq_len, num_heads, w, r, causal) for w, r in self.params.branches()
        )
        return attention_flops(batch * pairs, head_dim, backward=backward)


register(
    KernelSpec(
        name="dilated",
        primitive=True,
        description=(
            "LongNet dilated attention: segments w_i with dilation r_i, every head in every "
            "branch (contiguous head groups per offset), branches mixed by log-sum-exp."
        ),
        params=DilatedParams,
        factory=DilatedAttention,
        check=check_dilated,
        periods=lambda params: params.segment_lengths,
        exact=Exact.DILATED,
        device_plan=True,
        bench_params=BenchParams(
            cpu=({"segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4]},),
            gpu={  # LongNet's segments up to 32K
                "segment_lengths": [2048, 4096, 8192, 16384, 32768],
                "dilation_rates": [1, 2, 4, 6, 12],
            },
        ),
    )
)
