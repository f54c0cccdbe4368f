"""`sdpa`: torch's scaled_dot_product_attention with its backend named, not chosen for you.

backend flash | efficient | cudnn | math runs under torch.nn.attention.sdpa_kernel with only
that backend allowed; one the device and dtype do not support is an error naming
params.backend, never a silent fall back to another backend. (On CPU torch offers math and
flash.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention.adapters import adapter_specs, check_choice, sdpa_bshd
from attention.base import ExactKernel
from attention.errors import ParamError
from attention.registry import KernelSpec

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


NO_BACKEND = ("No available kernel", "No viable backend")


@dataclass(frozen=True)
class SdpaParams:
    """backend: flash | efficient | cudnn | math (the only one SDPA may use)."""

    backend: str = "math"

    def __post_init__(self) -> None:
        check_choice("params.backend", self.backend, BACKENDS)


class SdpaAttention(ExactKernel):
    """`module(q, k, v, *, causal=False)` on (batch, seq, heads, head_dim) tensors."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        name = self.params.backend
        try:
            with sdpa_kernel([BACKENDS[name]]):
                out = sdpa_bshd(q, k, v, is_causal=causal)
        except RuntimeError as exc:  # torch's words for "this backend cannot run it"
            if not any(words in str(exc) for words in NO_BACKEND):
                raise
            raise ParamError(
                "params.backend",
                f"SDPA's {name} backend does not run {q.dtype} on {q.device.type} with this "
                f"shape (torch {torch.__version__}); pick another backend",
            ) from exc
        self.backend = f"sdpa-{name}-{q.device.type}"
        return out


def kernel_specs() -> list[KernelSpec]:
    return adapter_specs(
        "sdpa",
        "torch scaled_dot_product_attention with one backend named (flash, efficient, cudnn or "
        "math); an unsupported one is an error, not a fallback.",
        SdpaParams,
        SdpaAttention,
    )
