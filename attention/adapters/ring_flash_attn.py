"""`ring_flash_attn`: zhuzilin's ring-flash-attention (package ring-flash-attn), CUDA + NCCL,
its zigzag ring or its plain ring, for comparing with ringlab's `ring`.

Written against its documented `zigzag_ring_flash_attn_func(q, k, v, causal=..., group=...)`
and `ring_flash_attn_func` on (batch, local seq, heads, head_dim) shards, zigzag or contiguous;
never run in ringlab's CI, which has no GPU: the correctness gate checks it on the first GPU
run. Its llama3 variant (varlen, all-gather of K/V) is not adapted yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version

import torch
import torch.distributed as dist
from ring_flash_attn import ring_flash_attn_func, zigzag_ring_flash_attn_func

from attention.base import Kernel, attention_flops, causal_pairs
from attention.errors import ParamError
from attention.layouts import positions
from attention.registry import KernelSpec

VERSION = version("ring-flash-attn")
LAYOUTS = {"zigzag": "zigzag", "ring": "contiguous"}


@dataclass(frozen=True)
class RingFlashAttnParams:
    """variant: zigzag (causal-balanced shards) or ring (contiguous shards)."""

    variant: str = "zigzag"

    def __post_init__(self) -> None:
        if self.variant not in LAYOUTS:
            raise ParamError(
                "params.variant", f"expected one of {', '.join(LAYOUTS)}, got {self.variant!r}"
            )


class RingFlashAttn(Kernel):
    """`module(q, k, v, *, causal=False)` on this rank's shard (CUDA, NCCL, fp16/bf16)."""

    def __init__(self, params: RingFlashAttnParams) -> None:
        super().__init__()
        self.params = params
        self.backend = f"ring-flash-attn-{VERSION}-{params.variant}"

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        return positions(seq_len, LAYOUTS[self.params.variant], rank, world_size)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"ring_flash_attn runs fp16/bf16 on CUDA only, got {q.dtype} on {q.device.type}"
            )
        func = (
            zigzag_ring_flash_attn_func if self.params.variant == "zigzag" else ring_flash_attn_func
        )
        return func(q, k, v, causal=causal, group=dist.group.WORLD)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        world = dist.get_world_size() if dist.is_initialized() else 1
        total = seq_len * world
        pairs = (causal_pairs(total) if causal else total * total) // world
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)


def kernel_specs() -> list[KernelSpec]:
    return [
        KernelSpec(
            name="ring_flash_attn",
            description="zhuzilin's ring-flash-attention, zigzag or plain ring (CUDA, NCCL).",
            params=RingFlashAttnParams,
            factory=RingFlashAttn,
            distributed=True,
        )
    ]
