"""The flex adapters cache their BlockMask per (pattern, shape, device), bounded, and report the
seconds a forward spent building masks as `mask_build_s` (issue 37 item 4.3)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attention
from attention.adapters import flex

FLEX = [
    ("flex_block_sparse", {"block_size": 32, "pattern": "local_window", "window": 2}, 1),
    ("flex_dilated", {"segment_lengths": [32, 64], "dilation_rates": [1, 2]}, 2),
]
"""(kernel, params, masks one forward builds: one per dilated branch)."""


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every BlockMask the adapters build (a cache miss), as (heads, seq_len)."""
    calls: list[tuple[int, int]] = []
    real = flex.MaskCache.get

    def counting(self: flex.MaskCache, pattern: Any, build: Any, q: torch.Tensor) -> Any:
        def counted() -> Any:
            calls.append((q.shape[2], q.shape[1]))
            return build()

        return real(self, pattern, counted, q)

    monkeypatch.setattr(flex.MaskCache, "get", counting)
    return calls


def _build_s(module: torch.nn.Module) -> float:
    """The seconds the module's last forward spent building masks."""
    value = module.mask_build_s
    assert isinstance(value, float)
    return value


def _qkv(seq: int, heads: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(1, seq, heads, 8, generator=g) for _ in range(3))


@pytest.mark.parametrize(("kernel", "params", "per_forward"), FLEX)
def test_a_shape_builds_its_masks_once(
    builds: list[tuple[int, int]], kernel: str, params: dict, per_forward: int
) -> None:
    module = attention.build(kernel, **params, compiled=False)
    first = module(*_qkv(128), causal=True)
    assert len(builds) == per_forward and _build_s(module) > 0
    again = module(*_qkv(128), causal=True)
    assert len(builds) == per_forward and _build_s(module) == 0.0  # all cached
    assert torch.equal(first, again)  # same inputs (seeded by length), same masks
    module(*_qkv(256), causal=True)  # a new length
    assert len(builds) == 2 * per_forward and builds[-1] == (2, 256)
    module(*_qkv(128, heads=4), causal=True)  # new heads
    module(*_qkv(128), causal=False)  # causal is part of the pattern
    assert len(builds) == 4 * per_forward and _build_s(module) > 0


def test_a_cached_mask_gives_what_a_fresh_one_gives(builds: list[tuple[int, int]]) -> None:
    """The cached mask is the shape's own: a fresh module at each length agrees with one module
    that went through several lengths."""
    params = {"block_size": 32, "pattern": "local_window", "window": 2, "compiled": False}
    shared = attention.build("flex_block_sparse", **params)
    for seq in (128, 256, 128):
        fresh = attention.build("flex_block_sparse", **params)
        q, k, v = _qkv(seq)
        torch.testing.assert_close(shared(q, k, v, causal=True), fresh(q, k, v, causal=True))


def test_the_cache_is_bounded_least_recently_used_first(
    builds: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flex, "MASK_CACHE_SIZE", 2)
    module = attention.build(
        "flex_block_sparse", block_size=32, pattern="local_window", window=2, compiled=False
    )
    for seq in (64, 96, 64, 128):  # 64 used again before 128 arrives: 96 goes
        module(*_qkv(seq), causal=False)
    assert [s for _, s in builds] == [64, 96, 128]
    module(*_qkv(64), causal=False)
    module(*_qkv(96), causal=False)
    assert [s for _, s in builds] == [64, 96, 128, 96]


def test_flex_block_sparse_builds_its_mask_from_the_block_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """flex_block_sparse's BlockMask comes from block_sparse's (n, n) block mask (tiles of at
    least 128 tokens), never create_block_mask's (1, H, S, S) materialization, and its
    output equals the masked reference computed by our kernel."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("create_block_mask materializes (1, H, S, S)")

    monkeypatch.setattr(torch.nn.attention.flex_attention, "create_block_mask", refused)
    params = {"block_size": 32, "pattern": "random", "num_random": 2, "seed": 3}
    module = attention.build("flex_block_sparse", **params, compiled=False)
    ours = attention.build("block_sparse", **params)
    q, k, v = _qkv(250)  # a short last block, partial last tile
    for causal in (False, True):
        got = module(q, k, v, causal=causal)
        torch.testing.assert_close(got, ours(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)
        mask = module.masks.get(("block_sparse", causal), lambda: None, q)  # the cached one
        assert mask is not None and mask.BLOCK_SIZE == (128, 128)
