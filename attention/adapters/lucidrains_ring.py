"""`lucidrains_ring`: lucidrains' ring-attention-pytorch (`ring_flash_attn`, its pure-torch
ring), one contiguous shard per rank, over torch.distributed (gloo on CPU).

Called with ring_reduce_col=True: with its default (False) the function passes no K/V around
the ring and each rank attends its own shard only, which the gate would fail.

Known bug, kept visible: in 0.5.20 the ring backward unpacks its (dk, dv) pair wrongly
(`dk, dv = dkv`), so dK comes out as dK + dV of the rank and dV as another rank's sum. Its
forward is right; in train mode the correctness gate stops every run of it (tests show it
does). Pin: ring-attention-pytorch==0.5.20 (the `adapters` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version

import torch
import torch.distributed as dist
from ring_attention_pytorch import ring_flash_attn

from attention.adapters import RingAdapter, adapter_specs
from attention.errors import ParamError
from attention.registry import KernelSpec

VERSION = version("ring-attention-pytorch")


@dataclass(frozen=True)
class LucidrainsRingParams:
    """bucket_size: the query/key block its flash-style loop computes at a time."""

    bucket_size: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ParamError(
                "params.bucket_size", f"must be an integer >= 1, got {self.bucket_size!r}"
            )


class LucidrainsRing(RingAdapter):
    """`module(q, k, v, *, causal=False)` on this rank's contiguous shard."""

    def __init__(self, params: LucidrainsRingParams) -> None:
        super().__init__(params)
        self.backend = f"ring-attention-pytorch-{VERSION}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        world = dist.get_world_size() if dist.is_initialized() else 1
        # ring_reduce_col=True: the ring itself (False, its default, attends the local K/V only)
        return ring_flash_attn(
            q,
            k,
            v,
            causal=causal,
            bucket_size=self.params.bucket_size,
            ring_reduce_col=True,
            ring_size=world,
        )


def kernel_specs() -> list[KernelSpec]:
    return adapter_specs(
        "lucidrains_ring",
        "lucidrains' ring-attention-pytorch ring (pure torch, gloo on CPU); its 0.5.20 backward "
        "returns wrong dK/dV, which the correctness gate catches.",
        LucidrainsRingParams,
        LucidrainsRing,
    )
