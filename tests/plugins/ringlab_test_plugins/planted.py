"""`planted_dense`: exact dense attention (SDPA) that repeats its work `slowdown` times, the
factor read from the named Ray actor SLOWDOWN_ACTOR when the kernel is built (1 while no such
actor exists, the code "as shipped"). It stands in for a commit that makes a kernel 2x slower
without changing its name or params: two sweeps of the same cells, one of them "new code",
for the regression gate's test (tests/service/test_regression_gate.py). The output is always
right."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from attention import ExactKernel, KernelSpec
from ringlab_test_plugins import NoParams, one_kernel

SLOWDOWN_ACTOR = "ringlab-test-planted-slowdown"
"""A Ray actor of this name in the job's namespace with a `slowdown()` method plants the bug."""


def planted_slowdown() -> int:
    """The factor SLOWDOWN_ACTOR holds; 1 where Ray is not running or no such actor exists."""
    import ray

    if not ray.is_initialized():
        return 1
    try:
        actor = ray.get_actor(SLOWDOWN_ACTOR)
    except ValueError:  # no actor of that name: the code as shipped
        return 1
    return int(ray.get(actor.slowdown.remote(), timeout=30))


class PlantedDense(ExactKernel):
    backend = "sdpa"

    def __init__(self, params: NoParams) -> None:
        super().__init__(params)
        self.slowdown = planted_slowdown()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for _ in range(self.slowdown - 1):  # the planted regression: the same work again
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.transpose(1, 2)


def kernel_specs() -> list[KernelSpec]:
    description = "Dense attention, slowed down on request (the regression gate's test)."
    return one_kernel("planted_dense", description, PlantedDense)
