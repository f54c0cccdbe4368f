"""`unscaled_dense`: dense attention that forgets the 1/sqrt(head_dim) softmax scale, the bug
the correctness gate exists to catch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention import ExactKernel, KernelSpec


@dataclass(frozen=True)
class NoParams:
    """No parameters."""


class UnscaledDense(ExactKernel):
    backend = "math"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)  # no * head_dim ** -0.5
        if causal:
            n = q.shape[1]
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def kernel_specs() -> list[KernelSpec]:
    return [
        KernelSpec(
            name="unscaled_dense",
            description="Dense attention without the softmax scale (wrong on purpose).",
            params=NoParams,
            factory=UnscaledDense,
        )
    ]
