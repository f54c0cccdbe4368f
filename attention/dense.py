"""`dense`: exact softmax attention through PyTorch's SDPA: the reference and the baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention.base import (
    Kernel,
    KernelMemory,
    attention_flops,
    causal_pairs,
    check_qkv,
    qkv_bytes,
)
from attention.registry import KernelSpec, register


@dataclass(frozen=True)
class DenseParams:
    """`dense` takes no parameters."""


class DenseAttention(Kernel):
    """softmax(q k^T / sqrt(d)) v over the whole sequence, causal optional; k and v may have
    fewer heads (grouped-query attention: SDPA's enable_gqa)."""

    def __init__(self, params: DenseParams | None = None) -> None:
        super().__init__()
        self.params = params or DenseParams()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        self.backend = "sdpa"
        # (b s h d) -> (b h s d) for SDPA and back
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=causal,
            enable_gqa=k.shape[2] != q.shape[2],
        )
        return out.transpose(1, 2)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        pairs = causal_pairs(seq_len) if causal else seq_len * seq_len
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """SDPA (fused) saves q, k, v, its output and the fp32 log-sum-exp; the output it
        returns is the saved one. Backward allocates dq, dk, dv in the input dtype."""
        one = qkv_bytes(batch, seq_len, num_heads, head_dim, dtype_bytes)
        lse = 4 * batch * num_heads * seq_len
        return KernelMemory(
            saved=4 * one + lse, output_saved=True, forward_transient=0, backward_transient=3 * one
        )


register(
    KernelSpec(
        name="dense",
        description="Exact softmax attention (PyTorch SDPA): the reference and the baseline.",
        params=DenseParams,
        factory=DenseAttention,
    )
)
