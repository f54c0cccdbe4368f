"""attention.compiled: each compiled kernel its own cache and limit, the backend setting, and
the flex adapters through torch.compile on CPU under the eager backends (issue 49 item 1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo

import attention
from attention import compiled

SPARSE = {"block_size": 16, "pattern": "local_window", "window": 1}


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(seq: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(1, seq, 2, 16, generator=g).requires_grad_(grad) for _ in range(3))


def test_the_setting_names_itself_when_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.BACKEND_ENV, "cudagraphs")
    with pytest.raises(ValueError, match="RINGLAB_COMPILE_BACKEND: must be one of inductor"):
        attention.build("block_sparse", **SPARSE, plan="cuda")(*_qkv(64))
    monkeypatch.delenv(compiled.BACKEND_ENV)
    assert compiled.backend("cuda") == "inductor" and compiled.backend("cpu") is None


def test_each_kernel_has_its_own_cache_and_limit(
    eager_compile: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both call FlexAttention: compiled through one function they would share one cache, and
    the second kernel's shapes would count against the first's limit."""
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 2)
    plan = attention.build("block_sparse", **SPARSE, plan="cuda")
    adapter = attention.build("flex_block_sparse", **SPARSE)
    before = compiled.stats()
    with torch.no_grad():
        for module in (plan, adapter):
            for seq in (64, 128):
                module(*_qkv(seq))
    assert compiled.stats().since(before).compilations == 4
    assert plan.backend == "flex-compiled-plan-cuda" and adapter.backend == "flex-compiled"
    with pytest.raises(compiled.RecompileLimitError, match="'flex_block_sparse' hit"):
        adapter(*_qkv(192))


def test_the_flex_adapters_train_on_cpu_under_the_eager_backend(eager_compile: None) -> None:
    """FlexAttention's op and its autograd, compiled: outputs and gradients equal our kernels'
    (flex_dilated's branches merged by the lse the compiled op returns)."""
    for name, ours, params in (
        ("flex_block_sparse", "block_sparse", SPARSE),
        ("flex_dilated", "dilated", {"segment_lengths": [32, 64], "dilation_rates": [1, 2]}),
    ):
        got, want = _qkv(128, grad=True), _qkv(128, grad=True)
        flex = attention.build(name, **params)
        out = flex(*got, causal=True)
        ref = attention.build(ours, **params)(*want, causal=True)
        assert flex.backend == "flex-compiled"
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        ref.sum().backward()
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
