"""`exit_on_rank`: dense attention whose process kills itself (SIGKILL, as the OOM killer or a
lost node would) on one rank of a W > 1 run, the moment it first runs: the gang must then kill
the other ranks, which wait for it in a collective, instead of leaving them hanging."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

from attention import ExactKernel, KernelSpec
from ringlab_test_plugins import one_kernel


@dataclass(frozen=True)
class ExitParams:
    """rank: the rank whose process kills itself (in a process group; alone it never does)."""

    rank: int = 1


class ExitOnRank(ExactKernel):
    backend = "sdpa"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == self.params.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        )
        return out.transpose(1, 2)


def kernel_specs() -> list[KernelSpec]:
    description = "Dense attention whose process kills itself on one rank (on purpose)."
    return one_kernel("exit_on_rank", description, ExitOnRank, ExitParams)
