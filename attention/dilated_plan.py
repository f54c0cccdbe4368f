"""`dilated`'s cuda plan: one fused call per branch and head group, segments folded into the batch.

The cpu plan (`attention.dilated`) bounds every call's rows so that the CPU op's buffers and the
kernel's temporaries stay small; on a GPU that plan is host-bound (thousands of calls of ~15
launches each). This plan makes the fewest calls the semantics allow, as torchscale does:
for a branch (w, r) over a sequence of S tokens, the S // w whole segments of every batch row are
one batch of a fused call, (B, S, H, D) -> (B * S/w, w, H, D), a view; head group g (heads
[h0, h1)) keeps rows g, g + r, ... of each segment, a strided view of that fold
((B * S/w, h1 - h0, m, D) in the ops' (B, H, S, D) order, row stride r tokens); the shorter last
segment, if any, is one more call. So a branch and group costs at most 2 fused calls forward and 2
backward (GQA: one per run of kv heads the group spans), whatever S is. A fold across batch rows
needs the runs to span the sequence (S % w == 0) or B == 1; otherwise each batch row is its own
call. No index tensors: every view is an `as_strided` of q, k, v, out, lse and the gradients.

Semantics are exactly the cpu plan's (module docstring of `attention.dilated`): same segments,
tails, offsets and causal rows (a segment's rows attend causally among themselves: a square).
Memory: the first branch (lowest rate) writes its result straight into the output (a rate-1
branch's fused output IS the output when its segments divide S); later branches are merged
in place by their lse (out <- lerp(out, out_b, sigmoid(lse_b - lse)), lse <- logaddexp), so
the only temporaries are one call's result (a 1/r^2 share of the output for r >= 2) and its
weights. The output is merged in the inputs' dtype: for bf16/fp16 one rounding per branch (as
torchscale's merge), where the cpu plan keeps fp32 windows; fp32 and fp64 merge in their own
(the accumulator) dtype exactly as the cpu plan. lse is kept (B, S, H) in memory (returned as its
(B, H, S) view), since only that order folds segments into the batch.
The backward recomputes each call with the final merged (out, lse) (FlashAttention-2; the fused
lse carries no gradient) and adds its dq, dk, dv through the same views into gradients in the
inputs' dtype: for bf16/fp16 one rounding per branch a row takes part in, as the forward's merge
and as torchscale (autograd sums the branches' gradients of a bf16 tensor in bf16). fp32
accumulators would hold 3 fp32 copies of q's size beyond the gradients themselves: at 128K
(h16, d128) half the backward's floor again, against issue 37's quarter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attention import primitive
from attention.segments import group_bounds, head_window, offset_rows


@dataclass(frozen=True)
class Call:
    """One fused call's rows: positions start + offset + s*stride + i*rate (s < count, i < m)
    of query heads [h0, h1) reading kv heads [k0, k1); `first`: of the first branch (copied,
    not merged); `fold`: every batch row in the call's batch (else one call per batch row)."""

    start: int
    count: int
    stride: int
    offset: int
    rate: int
    m: int
    h0: int
    h1: int
    k0: int
    k1: int
    first: bool
    fold: bool


def plan(
    branches: tuple[tuple[int, int], ...], batch: int, seq_len: int, heads: int, kv_heads: int
) -> tuple[Call, ...]:
    """The calls of every branch (w, r) (in the order given: the first is copied) over a
    sequence: the whole segments as one run, the shorter tail as another; per run, one call per
    head group and run of kv heads. A pure function of the shapes and of the global head window
    (segments.global_heads: Ulysses), cached."""
    return _plan(branches, batch, seq_len, heads, kv_heads, head_window())


@functools.lru_cache(maxsize=256)
def _plan(
    branches: tuple[tuple[int, int], ...],
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    window: tuple[int, int] | None,
) -> tuple[Call, ...]:
    """`plan`, its head window (read by group_bounds) in the cache key."""
    calls = []
    for index, (w, r) in enumerate(branches):
        full, tail = divmod(seq_len, w)
        runs = [(0, full, w, w)] if full else []
        if tail:
            runs.append((full * w, 1, tail, tail))
        for start, count, stride, length in runs:
            fold = batch == 1 or count * stride == seq_len
            for g, h0, h1 in group_bounds(heads, r):
                m = offset_rows(length, g, r)
                for a0, a1, k0, k1 in (
                    primitive.kv_head_pieces(h0, h1, heads, kv_heads) if m else ()
                ):
                    calls.append(
                        Call(start, count, stride, g, r, m, a0, a1, k0, k1, index == 0, fold)
                    )
    return tuple(calls)


def rows(x: torch.Tensor, call: Call, b: int | None, kv: bool = False) -> torch.Tensor:
    """The call's rows of x (B, S, H, D) as (N, h, m, D) (N = B * count folded, else count of
    batch row b); kv: heads [k0, k1) instead of [h0, h1)."""
    sb, ss, sh, sd = x.stride()
    h0, h1 = (call.k0, call.k1) if kv else (call.h0, call.h1)
    n = call.count * (x.shape[0] if b is None else 1)
    offset = x.storage_offset() + (b or 0) * sb + (call.start + call.offset) * ss + h0 * sh
    size = (n, h1 - h0, call.m, x.shape[3])
    return x.as_strided(size, (call.stride * ss, sh, call.rate * ss, sd), offset)


def lse_rows(lse: torch.Tensor, call: Call, b: int | None) -> torch.Tensor:
    """The call's rows of lse (B, H, S) (stored (B, S, H)) as (N, h1 - h0, m)."""
    sb, sh, ss = lse.stride()
    n = call.count * (lse.shape[0] if b is None else 1)
    offset = lse.storage_offset() + (b or 0) * sb + (call.start + call.offset) * ss + call.h0 * sh
    return lse.as_strided(
        (n, call.h1 - call.h0, call.m), (call.stride * ss, sh, call.rate * ss), offset
    )


def _batch_rows(call: Call, batch: int) -> list[int | None]:
    return [None] if call.fold else list(range(batch))


def _check_dense(*tensors: torch.Tensor) -> None:
    """The folded views read batch row b + 1 right after row b: (B, S, ...) must be dense."""
    for t in tensors:
        if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(
                f"dilated cuda plan: expected (B, S, ...)-dense tensors, got strides {t.stride()}"
            )


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branches: tuple[tuple[int, int], ...],
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out (B, S, H, D) in q's dtype, lse (B, H, S) in the accumulator dtype) of all
    branches of contiguous q (B, S, H, D), k, v (B, S, H_kv, D); no graph."""
    bsz, seq_len, heads, dim = q.shape
    _check_dense(q, k, v)
    backend = primitive.backend_for(q.device, q.dtype)
    calls = plan(branches, bsz, seq_len, heads, k.shape[2])
    acc = primitive.accumulator_dtype(q.dtype)
    lse = torch.full((bsz, seq_len, heads), float("-inf"), dtype=acc, device=q.device).transpose(
        1, 2
    )
    out: torch.Tensor | None = None
    for call in calls:
        for b in _batch_rows(call, bsz):
            o_b, l_b = primitive.fused_forward(
                backend, rows(q, call, b), rows(k, call, b, kv=True), rows(v, call, b, kv=True),
                scale=dim**-0.5, causal=causal,
            )  # fmt: skip
            if out is None:
                out = _adopt(o_b, q, call) if call.first else None
                if out is not None:
                    lse_rows(lse, call, b).copy_(l_b)
                    continue
                out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            if call.first:
                rows(out, call, b).copy_(o_b)
                lse_rows(lse, call, b).copy_(l_b)
            else:
                _merge_(rows(out, call, b), lse_rows(lse, call, b), o_b, l_b)
            del o_b, l_b
    if out is None:  # no call (empty sequence)
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    return out, lse


def _adopt(o_b: torch.Tensor, q: torch.Tensor, call: Call) -> torch.Tensor | None:
    """o_b (N, H, w, D) as the whole output (B, S, H, D) when it is every row of every head
    (a rate-1 first call over whole segments of every batch row) laid out (N, w, H, D)
    contiguous in q's dtype, as the fused ops allocate it; else None."""
    whole = call.rate == 1 and call.fold and call.h1 - call.h0 == q.shape[2] and call.k0 == 0
    if not whole or call.count * call.stride != q.shape[1] or o_b.dtype != q.dtype:
        return None
    t = o_b.transpose(1, 2)  # (N, w, H, D)
    return t.view(q.shape) if t.is_contiguous() else None


def _merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge one call's (out_b (N, h, m, D), lse_b (N, h, m)) into the views (out, lse) in place:
    out <- out + sigmoid(lse_b - lse) * (out_b - out) (lerp, in out's dtype), lse <-
    logaddexp(lse, lse_b). lse_b is finite (every row of a call sees a key), so no NaN; an
    uncovered row (lse -inf) takes out_b exactly."""
    weight = (lse_b - lse).sigmoid_()
    torch.logaddexp(lse, lse_b, out=lse)
    out.lerp_(out_b, weight.unsqueeze(-1).to(out.dtype))


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    branches: tuple[tuple[int, int], ...],
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtype (module docstring): each call's fused backward with the
    final merged (out, lse), added through the call's views (dout, q, k, v, out contiguous
    (B, S, H, D)). The gradients are made at the first call, one at a time, each op gradient
    freed once added: a first call over every row (rate 1, whole segments) fills them instead
    of adding to zeros, so the op's three gradients and three zeroed ones never coexist."""
    bsz, seq_len, heads, dim = q.shape
    _check_dense(dout, q, k, v, out, lse.transpose(1, 2))
    backend = primitive.backend_for(q.device, q.dtype)
    grads: list[torch.Tensor | None] = [None, None, None]
    for call in plan(branches, bsz, seq_len, heads, k.shape[2]):
        for b in _batch_rows(call, bsz):
            parts = list(primitive.fused_backward(
                backend, rows(dout, call, b), rows(q, call, b), rows(k, call, b, kv=True),
                rows(v, call, b, kv=True), rows(out, call, b), lse_rows(lse, call, b),
                scale=dim**-0.5, causal=causal,
            ))  # fmt: skip
            for i, like in enumerate((q, k, v)):
                part = parts.pop(0)  # the op's gradient lives until added
                grad = grads[i]
                if grad is None:
                    make = torch.empty if _covers_all(call, like, kv=i > 0) else torch.zeros
                    grads[i] = grad = make(like.shape, dtype=q.dtype, device=like.device)
                    if make is torch.empty:
                        rows(grad, call, b, kv=i > 0).copy_(part)
                        continue
                rows(grad, call, b, kv=i > 0).add_(part)
            del part
    if grads[0] is None:  # no call (empty sequence)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return grads[0], grads[1], grads[2]  # type: ignore[return-value]


def _covers_all(call: Call, like: torch.Tensor, kv: bool) -> bool:
    """Whether the call's rows are every row of every head of `like` (B, S, H, D) (kv: its kv
    heads): a rate-1 call over whole segments of every batch row."""
    h0, h1 = (call.k0, call.k1) if kv else (call.h0, call.h1)
    return (
        call.rate == 1 and call.fold and call.count * call.stride == like.shape[1]
        and (h0, h1) == (0, like.shape[2])
    )  # fmt: skip
