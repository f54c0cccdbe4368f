"""What every kernel shares: the call signature, input checks and FLOP accounting."""

from __future__ import annotations

import torch
from torch import nn

BACKWARD_FLOP_FACTOR = 2.5
"""Backward FLOPs per forward FLOP (FlashAttention convention: fwd+bwd = 3.5x forward)."""


def attention_flops(pairs: int, head_dim: int, *, backward: bool = False) -> int:
    """FLOPs of attention over `pairs` (query, key) dot products summed over batch and heads.

    Forward is 4·pairs·d (QK^T and PV, a multiply-add each); backward adds 2.5x that.
    """
    fwd = 4 * pairs * head_dim
    return int(fwd * (1 + BACKWARD_FLOP_FACTOR)) if backward else fwd


def causal_pairs(seq_len: int) -> int:
    """Query-key pairs a causal mask keeps in a square of `seq_len` tokens."""
    return seq_len * (seq_len + 1) // 2


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are (batch, seq, heads, head_dim) tensors that match."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v: expected 4-D (batch, seq, heads, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(
            f"q, k, v: shapes must match, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v: dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v: expected a floating dtype, got {q.dtype}")


class Kernel(nn.Module):
    """Base of every kernel: `module(q, k, v, *, causal=False) -> out` with q's shape and dtype.

    `backend` names the primitive backend the last call ran (for results to record);
    `flops(...)` counts only the query-key pairs the kernel actually computes.
    """

    backend: str | None = None

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """FLOPs of one call on (batch, seq_len, num_heads, head_dim) inputs of this rank."""
        raise NotImplementedError
