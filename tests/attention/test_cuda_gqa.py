"""GQA on the fused CUDA ops without repeating K/V where the op runs grouped heads (issue 37
item 4.4): the flash op (fp16/bf16) takes the kv heads as they are, the efficient op (fp32),
which has no grouped heads, still gets them repeated. Checked on CPU by what building each
call's arguments allocates (a TorchDispatchMode over every aten op), and on the meta device
by the ops' own shape kernels; the values are a GPU's to check (tests/workers/test_cuda.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attention import primitive

B, H, H_KV, SQ, SK, D = 2, 8, 2, 40, 48, 16


class Allocations(TorchDispatchMode):
    """The tensors each aten op returns in new storage (not a view of one of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.new: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        self.new += [
            t
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
        ]
        return out

    def kv_sized(self, heads: int) -> int:
        """Bytes of new tensors of K's or V's size at that head count (repeat_interleave copies
        through a (B, H_KV, G, SK, D) expand)."""
        return sum(t.nbytes for t in self.new if t.numel() == B * heads * SK * D)


def _qkv(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, SQ, H, D, generator=g).to(dtype)
    k, v = (torch.randn(B, SK, H_KV, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _named(op: Any, args: tuple) -> dict[str, Any]:
    return dict(zip([a.name for a in op._schema.arguments], args, strict=False))


def test_the_flash_forward_gets_k_and_v_unrepeated() -> None:
    q, k, v = _qkv(torch.bfloat16)
    with Allocations() as seen:
        op, args, _ = primitive._cuda_forward_args(
            "cuda_flash", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.25, True
        )
    assert seen.new == []  # views only: not a byte for K/V
    named = _named(op, args)
    for name, given in (("key", k), ("value", v)):
        assert named[name].shape == (B, H_KV, SK, D)
        assert named[name].untyped_storage().data_ptr() == given.untyped_storage().data_ptr()


def test_the_efficient_forward_still_repeats_them() -> None:
    """The efficient op has no grouped heads: K and V are copied at H heads, as measured."""
    q, k, v = _qkv(torch.float32)
    with Allocations() as seen:
        op, args, _ = primitive._cuda_forward_args(
            "cuda_efficient", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.25, True
        )
    assert seen.kv_sized(H) == 2 * B * H * SK * D * 4
    assert _named(op, args)["key"].shape == (B, H, SK, D)


@pytest.mark.parametrize(
    ("backend", "dtype", "kv_bytes"),
    [("cuda_flash", torch.bfloat16, 0), ("cuda_efficient", torch.float32, 2 * B * H * SK * D * 4)],
)
def test_the_backward_calls_repeat_k_and_v_only_for_the_efficient_op(
    backend: str, dtype: torch.dtype, kv_bytes: int
) -> None:
    q, k, v = _qkv(dtype)
    dout, out = torch.randn_like(q), torch.randn_like(q, dtype=torch.float32)
    lse = torch.randn(B, H, SQ)
    with Allocations() as seen:
        op, args, _ = primitive._cuda_backward_args(backend, dout, q, k, v, out, lse, 0.25, True)
    assert seen.kv_sized(H) == kv_bytes and seen.kv_sized(H_KV) == 0
    heads = H_KV if backend == "cuda_flash" else H
    assert _named(op, args)["key"].shape == (B, heads, SK, D)


def test_the_flash_ops_shape_kernels_take_grouped_heads() -> None:
    """On the meta device the flash forward gives out and lse per query head, and the
    fused backward (through _piece_backward) dk, dv per kv head."""
    meta = functools.partial(torch.randn, dtype=torch.bfloat16, device="meta")
    q, k, v = meta(B, SQ, H, D), meta(B, SK, H_KV, D), meta(B, SK, H_KV, D)
    out, lse = primitive._piece_forward("cuda_flash", q, k, v, 0.25, (0, SQ, 0, SK, True))
    assert out.shape == (B, SQ, H, D) and lse.shape == (B, H, SQ)
    dout, lse32 = meta(B, SQ, H, D), meta(B, H, SQ, dtype=torch.float32)
    piece = (0, SQ, 0, SK, True)
    dq, dk, dv = primitive._piece_backward("cuda_flash", dout, q, k, v, out, lse32, 0.25, piece)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
