"""torch_cp on CPU: torch's context_parallel really runs on 2 gloo ranks here, and fails with
the reason the adapter states when it refuses to load (listed unavailable, like flash_attn)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist_helpers import run_ranks

import attention
from attention.adapters.torch_cp import CPU_REFUSAL, cpu_refusal

pytestmark = pytest.mark.timeout(120)


def rank_context_parallel(rank: int, world: int, method: str) -> str:
    """torch's own recipe on this rank: shard q, k, v with context_parallel, run SDPA; the
    error it raises (or "ran")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(method)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_torch_context_parallel_fails_on_cpu_with_the_stated_reason(method):
    reason = cpu_refusal()
    assert reason == CPU_REFUSAL  # the catalogue states it without importing DTensor
    assert run_ranks(rank_context_parallel, 2, method) == [reason, reason]
    why = attention.registry.unavailable("torch_cp")
    assert why is not None and "CUDA-only" in why and reason in why
    with pytest.raises(ValueError, match=r"torch_cp.*CUDA-only"):
        attention.build("torch_cp")
