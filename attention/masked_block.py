"""One tile of attention under an arbitrary predicate `keep` (bool (Sq, Sk)): a mask's partial
tile (attention.ring.mask_plan), as (out, lse) and its FlashAttention-2 backward, the
primitive's contract (attention.primitive.block_forward / block_backward).

On CPU the fused op runs it under the predicate as an additive mask (it takes one and returns
its lse); a row keeping no key of the tile gets lse -inf and out 0 (the op reports lse 0 there,
which a merge would weigh as a real partial result). Elsewhere plain math in the accumulator
dtype: no fused CUDA op takes an arbitrary mask and returns its lse.
"""

from __future__ import annotations

import math

import torch

from attention import primitive
from attention.primitive import _math_backward, _math_forward, accumulator_dtype


def _check(keep: torch.Tensor, sq: int, sk: int) -> None:
    if keep.dtype != torch.bool or tuple(keep.shape) != (sq, sk):
        raise ValueError(f"keep: expected bool ({sq}, {sk}), got {keep.dtype} {tuple(keep.shape)}")


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The predicate as the additive mask the CPU fused op takes (0 kept, -inf not)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -math.inf)


def masked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_forward of q (B, Sq, H, D) against k, v (B, Sk, H_kv, D) under `keep`: out
    (B, Sq, H, D), lse (B, H, Sq) in the accumulator dtype (out: or the op's). No graph."""
    _check(keep, q.shape[1], k.shape[1])
    backend = primitive.backend_for(q.device, q.dtype)
    with torch.no_grad():
        if backend != "cpu_flash":
            return _math_forward(q, k, v, scale, False, keep)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, False, attn_mask=_additive(keep, q.dtype), scale=scale
        )
        lse = lse.to(accumulator_dtype(q.dtype)).masked_fill_(~keep.any(1), -math.inf)
        return out.transpose(1, 2), lse


def masked_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    keep: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_backward under `keep`: (dq, dk, dv) in the accumulator dtype (dk, dv with k's
    heads), from the FINAL merged out and lse of these rows."""
    _check(keep, q.shape[1], k.shape[1])
    backend = primitive.backend_for(q.device, q.dtype)
    acc = accumulator_dtype(q.dtype)
    lse = lse.to(acc).masked_fill(torch.isneginf(lse), math.inf)  # rows without any key: P 0
    with torch.no_grad():
        if backend != "cpu_flash":
            return _math_backward(dout, q, k, v, out, lse, scale, False, keep)
        views = (t.to(acc).transpose(1, 2) for t in (dout, q, k, v, out))
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *views, lse.contiguous(), 0.0, False, attn_mask=_additive(keep, acc), scale=scale
        )
        dq, dk, dv = (g.transpose(1, 2).to(acc) for g in grads)
        return dq, dk, dv
