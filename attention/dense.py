"""`dense`: exact softmax attention through PyTorch's SDPA: the reference and the baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention import documents
from attention.base import (
    Kernel,
    KernelMemory,
    attention_flops,
    check_qkv,
    qkv_bytes,
)
from attention.registry import KernelSpec, register


@dataclass(frozen=True)
class DenseParams:
    """document_lengths: documents packed into the sequence (attention.documents); None: the
    sequence is one document."""

    document_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "document_lengths", documents.normalize(self.document_lengths))


def check_dense(
    params: DenseParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Packed documents must fill the sequence."""
    documents.check_total(params.document_lengths, seq_len)


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
        lengths = self.params.document_lengths
        if lengths is None:
            return _sdpa(q, k, v, causal)
        documents.check_total(lengths, q.shape[1])
        return torch.cat(
            [_sdpa(q[:, a:b], k[:, a:b], v[:, a:b], causal) for a, b in documents.bounds(lengths)],
            dim=1,
        )

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        pairs = documents.pairs(self.params.document_lengths or (seq_len,), causal)
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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA on (b, s, h, d) tensors ((b, h, s, d) inside, and back)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


register(
    KernelSpec(
        name="dense",
        description="Exact softmax attention (PyTorch SDPA): the reference and the baseline; "
        "document_lengths packs several documents into the sequence.",
        params=DenseParams,
        factory=DenseAttention,
        check=check_dense,
    )
)
