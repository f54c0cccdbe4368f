"""`unscaled_dense`: dense attention that forgets the 1/sqrt(head_dim) softmax scale, the bug
the correctness gate exists to catch."""

from __future__ import annotations

import torch

from attention import ExactKernel, KernelSpec
from ringlab_test_plugins import one_kernel


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
    description = "Dense attention without the softmax scale (wrong on purpose)."
    return one_kernel("unscaled_dense", description, UnscaledDense)
