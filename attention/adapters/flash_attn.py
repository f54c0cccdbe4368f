"""`flash_attn`: Dao-AILab's FlashAttention 2 (package flash-attn) or 3 (flash_attn_interface,
Hopper), one GPU, fp16/bf16 only.

Written against their documented `flash_attn_func(q, k, v, causal=...)` on (batch, seq, heads,
head_dim) tensors (k and v may have fewer heads); never run in ringlab's CI, which has no GPU:
the correctness gate checks it on the first GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import torch
from flash_attn import flash_attn_func as fa2_func

from attention.adapters import adapter_specs, require_cuda_half
from attention.base import ExactKernel
from attention.errors import ParamError
from attention.registry import KernelSpec

VERSION = version("flash-attn")


@dataclass(frozen=True)
class FlashAttnParams:
    """version: 2 (flash-attn) or 3 (flash_attn_interface, built from flash-attention/hopper)."""

    version: int = 2

    def __post_init__(self) -> None:
        if self.version not in (2, 3):
            raise ParamError("params.version", f"expected 2 or 3, got {self.version!r}")


def _fa3() -> Any:
    try:
        from flash_attn_interface import flash_attn_func  # optional package (FlashAttention 3)
    except ImportError as exc:
        raise ParamError(
            "params.version",
            f"FlashAttention 3 needs flash_attn_interface (flash-attention/hopper): {exc}",
        ) from exc
    return flash_attn_func


class FlashAttn(ExactKernel):
    """`module(q, k, v, *, causal=False)` on (batch, seq, heads, head_dim) CUDA tensors."""

    def __init__(self, params: FlashAttnParams) -> None:
        super().__init__(params)
        self.func = fa2_func if params.version == 2 else _fa3()
        self.backend = f"flash-attn-{VERSION}" if params.version == 2 else "flash-attn-3"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        require_cuda_half("flash_attn", q)
        out = self.func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out  # FA3 also returns the lse


def kernel_specs() -> list[KernelSpec]:
    return adapter_specs(
        "flash_attn",
        "Dao-AILab FlashAttention 2 or 3 (CUDA, fp16/bf16).",
        FlashAttnParams,
        FlashAttn,
    )
