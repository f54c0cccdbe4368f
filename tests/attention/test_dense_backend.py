"""`dense` records the SDPA backend that ran (issue 37 item 4.1): torch's own choice for the
call's inputs and flags, the same aten op the profiler sees, and the choice follows an
sdpa_kernel context that allows only math."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile

import attention

OPS = {
    "flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "math": "aten::_scaled_dot_product_attention_math",
}
"""The aten op each CPU backend runs: what the profiler must see for the recorded name."""


def _qkv(kv_heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4, 8, generator=g)
    k, v = (torch.randn(1, 32, kv_heads, 8, generator=g) for _ in range(2))
    return q, k, v


def _ran(module: torch.nn.Module, *args: torch.Tensor, causal: bool) -> tuple[str, set[str]]:
    """The module's recorded backend and the SDPA backend ops the profiler saw."""
    with profile() as prof:
        module(*args, causal=causal)
    seen = {name for name, op in OPS.items() if any(e.name == op for e in prof.events())}
    return str(module.backend), seen


def _torch_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """What torch chooses for the same call ((b, h, s, d) as SDPA sees it)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = k.shape[2] != q.shape[2]
    chosen = SDPBackend(torch._fused_sdp_choice(qt, kt, vt, None, 0.0, causal, enable_gqa=gqa))
    return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.MATH: "math"}[chosen]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_recorded_backend_is_the_one_torch_chose_and_ran(causal: bool, kv_heads: int) -> None:
    q, k, v = _qkv(kv_heads)
    recorded, seen = _ran(attention.build("dense"), q, k, v, causal=causal)
    chosen = _torch_choice(q, k, v, causal)
    assert recorded == f"sdpa-{chosen}-cpu"
    assert seen == {chosen}


def test_only_math_allowed_records_math() -> None:
    q, k, v = _qkv()
    module = attention.build("dense")
    default, _ = _ran(module, q, k, v, causal=False)
    with sdpa_kernel([SDPBackend.MATH]):
        assert _torch_choice(q, k, v, False) == "math"
        recorded, seen = _ran(module, q, k, v, causal=False)
    assert (recorded, seen) == ("sdpa-math-cpu", {"math"})
    assert default == "sdpa-flash-cpu"  # torch 2.13's CPU choice for fp32 without a mask


def test_documents_name_every_backend_their_calls_ran_on() -> None:
    q, k, v = _qkv()
    module = attention.build("dense", document_lengths=[16, 16])
    with sdpa_kernel([SDPBackend.MATH]):
        recorded, seen = _ran(module, q, k, v, causal=True)
    assert (recorded, seen) == ("sdpa-math-cpu", {"math"})
