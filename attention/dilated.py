"""`dilated`: LongNet dilated attention (Ding et al. 2023) with the authors' head/offset semantics.

Branch i = (w_i, r_i): the sequence is cut into segments of w_i tokens; the heads are split into
r_i contiguous groups of ceil(H / r_i) heads; group g keeps, in every segment, the positions p
(counted from the segment start) with p % r_i == g, and those attend among themselves (causal on
the original positions when causal). Every head takes part in every branch. Branches are mixed
per (head, position) by softmax over their log-sum-exps (paper Eq. 10) through the primitive's
merge; a branch that does not cover a (head, position) has no weight there, and a (head,
position) no branch covers outputs 0 (possible when r_i > 1 in every branch).

The dilated rows of a group are strided views of q/k/v (no copies); each call of the primitive
takes a chunk of segments, so temporaries stay a fraction of the inputs. The backward recomputes
every branch with the final merged (out, lse) (FlashAttention-2), since the fused lse has no grad.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from attention import primitive
from attention.base import (
    Kernel,
    KernelMemory,
    attention_flops,
    causal_pairs,
    check_qkv,
    merged_memory,
)
from attention.hilbert import (
    check_hilbert_length,
    check_ordering,
    hilbert_permutation,
    inverse_permutation,
)
from attention.primitive import block_backward, block_forward, merge_
from attention.registry import KernelSpec, register

CHUNK_TOKENS = 16384
"""Tokens of one batch row per primitive call (whole segments, at least one)."""


def _int_tuple(field: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int | str) or not hasattr(value, "__iter__"):
        raise ValueError(f"params.{field}: expected a list of positive integers, got {value!r}")
    items = tuple(value)
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"params.{field}: expected positive integers, got {list(items)}")
    return items


@dataclass(frozen=True)
class DilatedParams:
    """segment_lengths w_i and dilation_rates r_i (same length, w_i % r_i == 0); token ordering."""

    segment_lengths: tuple[int, ...] = (2048, 4096, 8192)
    dilation_rates: tuple[int, ...] = (1, 2, 4)
    ordering: str = "natural"

    def __post_init__(self) -> None:
        w = _int_tuple("segment_lengths", self.segment_lengths)
        r = _int_tuple("dilation_rates", self.dilation_rates)
        object.__setattr__(self, "segment_lengths", w)
        object.__setattr__(self, "dilation_rates", r)
        if not w:
            raise ValueError("params.segment_lengths: must not be empty")
        if len(w) != len(r):
            raise ValueError(
                f"params.dilation_rates: must have one rate per segment length, got {len(r)} "
                f"rates for {len(w)} segment lengths"
            )
        for wi, ri in zip(w, r, strict=True):
            if wi % ri:
                raise ValueError(
                    f"params.segment_lengths: segment length {wi} must divide by its dilation "
                    f"rate {ri}"
                )
        check_ordering(self.ordering)


def check_dilated(
    params: DilatedParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Raise ValueError unless seq_len divides by every segment length (and is a power of 4
    under hilbert ordering)."""
    bad = [w for w in params.segment_lengths if seq_len % w]
    if bad:
        raise ValueError(
            f"seq_len: {seq_len} must divide by every segment length; it does not divide by "
            f"{', '.join(map(str, bad))}"
        )
    if params.ordering == "hilbert":
        check_hilbert_length(seq_len)


def _group_bounds(num_heads: int, rate: int) -> Iterator[tuple[int, int, int]]:
    """(offset g, first head, end head) of each non-empty head group of a branch with rate r."""
    size = math.ceil(num_heads / rate)
    for g in range(rate):
        h0, h1 = g * size, min(num_heads, (g + 1) * size)
        if h0 < h1:
            yield g, h0, h1


def _pieces(batch: int, seq_len: int, num_heads: int, w: int, r: int) -> Iterator[tuple]:
    """Index pieces (b, s0, s1, g, h0, h1): batch row, segment range, offset and head range."""
    n_seg = seq_len // w
    per_call = max(1, CHUNK_TOKENS // w)
    for b in range(batch):
        for s0 in range(0, n_seg, per_call):
            s1 = min(n_seg, s0 + per_call)
            for g, h0, h1 in _group_bounds(num_heads, r):
                yield b, s0, s1, g, h0, h1


def _rows(x: torch.Tensor, piece: tuple, w: int, r: int) -> torch.Tensor:
    """View (segments, w/r, heads, D) of x (B, S, H, D) holding one piece's dilated rows."""
    b, s0, s1, g, h0, h1 = piece
    n_seg = x.shape[1] // w
    return x[b].view(n_seg, w // r, r, x.shape[2], x.shape[3])[s0:s1, :, g, h0:h1]


def _lse_rows(lse: torch.Tensor, piece: tuple, w: int, r: int) -> torch.Tensor:
    """View (segments, heads, w/r) of lse (B, H, S) matching `_rows`."""
    b, s0, s1, g, h0, h1 = piece
    n_seg = lse.shape[2] // w
    return lse[b].view(lse.shape[1], n_seg, w // r, r)[h0:h1, s0:s1, :, g].transpose(0, 1)


def _branch_order(params: DilatedParams) -> list[tuple[int, int]]:
    """Branches by increasing rate: the first (widest coverage) is copied, the rest merged."""
    pairs = zip(params.segment_lengths, params.dilation_rates, strict=True)
    return sorted(pairs, key=lambda p: p[1])


def dilated_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: DilatedParams, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out fp32 (B,S,H,D), lse fp32 (B,H,S)) of all branches; no autograd graph."""
    bsz, seq_len, heads, dim = q.shape
    scale = dim**-0.5
    out = torch.zeros(bsz, seq_len, heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((bsz, heads, seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    for index, (w, r) in enumerate(_branch_order(params)):
        for piece in _pieces(bsz, seq_len, heads, w, r):
            o_b, l_b = block_forward(
                _rows(q, piece, w, r),
                _rows(k, piece, w, r),
                _rows(v, piece, w, r),
                scale=scale,
                causal=causal,
            )
            o_view, l_view = _rows(out, piece, w, r), _lse_rows(lse, piece, w, r)
            if index == 0:  # the first branch covers each (head, position) at most once
                o_view.copy_(o_b)
                l_view.copy_(l_b)
            else:
                merge_(o_view, l_view, o_b, l_b)
    return out, lse


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
    """fp32 (dq, dk, dv): every branch's block backward with the final merged (out, lse)."""
    bsz, seq_len, heads, dim = q.shape
    scale = dim**-0.5
    dq, dk, dv = (torch.zeros(q.shape, dtype=torch.float32, device=q.device) for _ in range(3))
    for w, r in _branch_order(params):
        for piece in _pieces(bsz, seq_len, heads, w, r):
            dq_b, dk_b, dv_b = block_backward(
                _rows(dout, piece, w, r),
                _rows(q, piece, w, r),
                _rows(k, piece, w, r),
                _rows(v, piece, w, r),
                _rows(out, piece, w, r),
                _lse_rows(lse, piece, w, r),
                scale=scale,
                causal=causal,
            )
            _rows(dq, piece, w, r).add_(dq_b)
            _rows(dk, piece, w, r).add_(dk_b)
            _rows(dv, piece, w, r).add_(dv_b)
    return dq, dk, dv


class _DilatedFunction(torch.autograd.Function):
    """Autograd wrapper: forward through the primitive, backward with the merged (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, params, causal):  # type: ignore[override]
        out, lse = dilated_forward(q, k, v, params, causal)
        ctx.params, ctx.causal = params, causal
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)  # fp32: `out` itself, saved above as the merged result

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = dilated_backward(dout.contiguous(), q, k, v, out, lse, ctx.params, ctx.causal)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class DilatedAttention(Kernel):
    """LongNet dilated attention over (B, S, H, D); see the module docstring for the semantics."""

    def __init__(self, params: DilatedParams | None = None) -> None:
        super().__init__()
        self.params = params or DilatedParams()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        check_dilated(self.params, seq_len=q.shape[1], num_heads=q.shape[2])
        self.backend = primitive.backend_for(q.device, q.dtype)
        q, k, v = (t.contiguous() for t in (q, k, v))
        if self.params.ordering == "hilbert":
            perm = hilbert_permutation(q.shape[1], q.device)
            q, k, v = q[:, perm], k[:, perm], v[:, perm]
            out = _DilatedFunction.apply(q, k, v, self.params, causal)
            return out[:, inverse_permutation(perm)]
        return _DilatedFunction.apply(q, k, v, self.params, causal)

    def token_masks(self, seq_len: int, num_heads: int, *, causal: bool = False) -> torch.Tensor:
        """Keep-masks (branches, H, S, S) on the (permuted, under hilbert) positions."""
        from attention.masks import dilated_branch_mask

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
        """Each head computes, per branch, S/w segments of (w/r)^2 pairs (causal: the triangle)."""
        pairs = 0
        for w, r in zip(self.params.segment_lengths, self.params.dilation_rates, strict=True):
            m = w // r
            pairs += (seq_len // w) * (causal_pairs(m) if causal else m * m)
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """See attention.base.merged_memory (q, k, v, the fp32 merged out and lse)."""
        return merged_memory(
            batch,
            seq_len,
            num_heads,
            head_dim,
            dtype_bytes,
            natural=self.params.ordering != "hilbert",
            chunk_tokens=CHUNK_TOKENS,
        )


register(
    KernelSpec(
        name="dilated",
        description=(
            "LongNet dilated attention: segments w_i with dilation r_i, every head in every "
            "branch (contiguous head groups per offset), branches mixed by log-sum-exp."
        ),
        params=DilatedParams,
        factory=DilatedAttention,
        check=check_dilated,
    )
)
