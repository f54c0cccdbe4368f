"""`ring_flash_attn`: zhuzilin's ring-flash-attention (package ring-flash-attn), CUDA + NCCL,
for comparing with ringlab's `ring`: its zigzag ring, its plain ring, or its llama3 variant
(contiguous shards, K/V all-gathered, variable-length documents through cu_seqlens).

Written against its documented functions: `zigzag_ring_flash_attn_func` and
`ring_flash_attn_func(q, k, v, causal=..., group=...)` on (batch, local seq, heads, head_dim)
shards, and `llama3_flash_attn_prepare_cu_seqlens` + `llama3_flash_attn_varlen_func` on
(local tokens, heads, head_dim) with batch 1. Never run in ringlab's CI, which has no GPU: the
correctness gate checks it on the first GPU run, against einsum attention under the document
mask (`document_lengths`, llama3 only; None: one document).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from itertools import accumulate

import torch
import torch.distributed as dist
from ring_flash_attn import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    ring_flash_attn_func,
    zigzag_ring_flash_attn_func,
)

from attention import documents
from attention.adapters import (
    RingAdapter,
    adapter_specs,
    check_choice,
    require_cuda_half,
    split_check,
)
from attention.errors import ParamError
from attention.masks import document_rows
from attention.registry import KernelSpec

VERSION = version("ring-flash-attn")
LAYOUTS = {"zigzag": "zigzag", "ring": "contiguous", "llama3": "contiguous"}


@dataclass(frozen=True)
class RingFlashAttnParams:
    """variant: zigzag (causal-balanced shards), ring (contiguous shards) or llama3 (contiguous,
    K/V all-gathered); document_lengths: packed documents (llama3 only)."""

    variant: str = "zigzag"
    document_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_choice("params.variant", self.variant, LAYOUTS)
        object.__setattr__(self, "document_lengths", documents.normalize(self.document_lengths))
        if self.document_lengths is not None and self.variant != "llama3":
            raise ParamError(
                "params.document_lengths", "packed documents run with variant llama3 only"
            )


def layout(params: RingFlashAttnParams, causal: bool | None) -> str:
    """The variant's layout: zigzag's shards, or contiguous ones (ring, llama3)."""
    return LAYOUTS[params.variant]


check = split_check(layout, lambda params: params.document_lengths)


def keep_mask(
    params: RingFlashAttnParams, seq_len: int, causal: bool, device: torch.device
) -> torch.Tensor:
    """The gate's mask: attention inside each document (the whole sequence: one document)."""
    return documents.document_mask(params.document_lengths or (seq_len,), causal, device)


def keep_rows(
    params: RingFlashAttnParams, seq_len: int, causal: bool, rows: torch.Tensor
) -> torch.Tensor:
    """keep_mask's rows `rows`, without the (seq_len, seq_len) mask."""
    return document_rows(params.document_lengths or (seq_len,), rows, causal)


class RingFlashAttn(RingAdapter):
    """`module(q, k, v, *, causal=False)` on this rank's shard (CUDA, NCCL, fp16/bf16)."""

    def __init__(self, params: RingFlashAttnParams) -> None:
        super().__init__(params)
        self.backend = f"ring-flash-attn-{VERSION}-{params.variant}"
        self.layout = LAYOUTS[params.variant]
        self.document_lengths = params.document_lengths

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        require_cuda_half("ring_flash_attn", q)
        group = dist.group.WORLD
        if self.params.variant == "zigzag":
            return zigzag_ring_flash_attn_func(q, k, v, causal=causal, group=group)
        if self.params.variant == "ring":
            return ring_flash_attn_func(q, k, v, causal=causal, group=group)
        return self._llama3(q, k, v, causal)

    def _llama3(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        if q.shape[0] != 1:
            raise ValueError(f"batch_size: the llama3 variant packs one sequence, got {q.shape[0]}")
        rank, world = dist.get_rank(), dist.get_world_size()
        lengths = self.params.document_lengths or (q.shape[1] * world,)
        cu = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k, local_k_slice = llama3_flash_attn_prepare_cu_seqlens(
            cu, causal=causal, rank=rank, world_size=world
        )
        out = llama3_flash_attn_varlen_func(
            q[0], k[0], v[0], cu_q, cu_k, max_q, max_k,
            heads_k_stride=1, local_k_slice=local_k_slice, causal=causal, group=dist.group.WORLD,
        )  # fmt: skip
        return out.unsqueeze(0)


def kernel_specs() -> list[KernelSpec]:
    return adapter_specs(
        "ring_flash_attn",
        "zhuzilin's ring-flash-attention: zigzag, plain ring or llama3 (variable-length "
        "documents) (CUDA, NCCL).",
        RingFlashAttnParams,
        RingFlashAttn,
        check=check,
        keep_mask=keep_mask,
        keep_rows=keep_rows,
    )
