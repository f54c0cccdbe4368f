"""The kernel catalogue: build, parameter validation and shape checks with field-named errors."""

from __future__ import annotations

import pytest
import torch

import attention


def test_dense_equals_explicit_softmax_forward_and_grad() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, 3, 8, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        out = attention.build("dense")(q, k, v, causal=causal)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        refs = torch.autograd.grad(ref, (q, k, v), g)
        for a, b in zip(grads, refs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unknown_kernel_and_parameter_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"^kernel: unknown kernel 'nope'; valid: .*dense"):
        attention.build("nope")
    with pytest.raises(ValueError, match=r"^params\.foo: unknown parameter"):
        attention.build("dense", foo=1)


def test_validate_names_world_size_and_seq_len() -> None:
    with pytest.raises(ValueError, match=r"^world_size: kernel 'dense' runs in one process"):
        attention.validate("dense", {}, seq_len=16, world_size=2)
    with pytest.raises(ValueError, match=r"^seq_len: must be >= 1"):
        attention.validate("dense", {}, seq_len=0)
    attention.validate("dense", {}, seq_len=16)


def test_dense_flops_count_causal_pairs() -> None:
    m = attention.build("dense")
    assert m.flops(1, 4, 1, 2) == 4 * 16 * 2
    assert m.flops(1, 4, 1, 2, causal=True) == 4 * 10 * 2
    assert m.flops(1, 4, 1, 2, backward=True) == int(4 * 16 * 2 * 3.5)


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(ValueError, match="q, k, v: shapes must match"):
        attention.build("dense")(
            torch.randn(1, 4, 1, 2), torch.randn(1, 5, 1, 2), torch.randn(1, 5, 1, 2)
        )
