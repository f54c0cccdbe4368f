"""`multihead`: projections around a kernel equal explicit projections around its reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attention
from attention.masks import dilated_reference

pytestmark = pytest.mark.timeout(60)


def _explicit(module, x, inner_reference, causal):
    """Projections written out with the module's weights around an fp64 reference kernel."""
    p = module.params
    heads, dim = p.num_heads, p.embed_dim // p.num_heads

    def proj(lin: nn.Linear, t):
        out = t @ lin.weight.double().T
        return out + lin.bias.double() if lin.bias is not None else out

    b, s, _ = x.shape
    q, k, v = (
        proj(lin, x).view(b, s, heads, dim) for lin in (module.q_proj, module.k_proj, module.v_proj)
    )
    return proj(module.out_proj, inner_reference(q, k, v, causal).reshape(b, s, p.embed_dim))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_multihead_dilated_matches_explicit_projections(causal, bias) -> None:
    torch.manual_seed(0)
    ws, rs = (4, 8), (1, 2)
    module = attention.build(
        "multihead",
        kernel="dilated",
        kernel_params={"segment_lengths": ws, "dilation_rates": rs},
        embed_dim=12,
        num_heads=3,
        bias=bias,
    )
    x64 = torch.randn(2, 16, 12, dtype=torch.float64, requires_grad=True)
    x = x64.detach().float().requires_grad_()
    out = module(x, causal=causal)
    ref = _explicit(
        module, x64, lambda q, k, v, c: dilated_reference(q, k, v, ws, rs, causal=c), causal
    )
    assert out.shape == (2, 16, 12)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    (dx,) = torch.autograd.grad(out, (x,), g.float())
    (dx_ref,) = torch.autograd.grad(ref, (x64,), g)
    torch.testing.assert_close(dx.double(), dx_ref, atol=1e-5, rtol=1e-5)


def test_multihead_dense_equals_torch_multihead_attention() -> None:
    torch.manual_seed(1)
    module = attention.build("multihead", kernel="dense", embed_dim=16, num_heads=4)
    torch_mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        w = torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight])
        torch_mha.in_proj_weight.copy_(w)
        b = torch.cat([module.q_proj.bias, module.k_proj.bias, module.v_proj.bias])
        torch_mha.in_proj_bias.copy_(b)
        torch_mha.out_proj.weight.copy_(module.out_proj.weight)
        torch_mha.out_proj.bias.copy_(module.out_proj.bias)
    inputs = [torch.randn(2, 10, 16, requires_grad=True) for _ in range(3)]
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    ours = module(*inputs)
    theirs, _ = torch_mha(*twins, need_weights=False)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ours)
    ours.backward(g)
    theirs.backward(g)
    for mine, ref in zip(inputs, twins, strict=True):  # dq, dk, dv
        torch.testing.assert_close(mine.grad, ref.grad, atol=1e-5, rtol=1e-5)
    in_w = torch.cat([m.weight.grad for m in (module.q_proj, module.k_proj, module.v_proj)])
    in_b = torch.cat([m.bias.grad for m in (module.q_proj, module.k_proj, module.v_proj)])
    torch.testing.assert_close(in_w, torch_mha.in_proj_weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(in_b, torch_mha.in_proj_bias.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        module.out_proj.weight.grad, torch_mha.out_proj.weight.grad, atol=1e-5, rtol=1e-5
    )
    assert module.backend == "sdpa-flash-cpu"


def test_flops_add_projections_to_the_inner_kernel() -> None:
    module = attention.build(
        "multihead",
        kernel="block_sparse",
        kernel_params={"block_size": 4, "window": 1},
        embed_dim=16,
        num_heads=2,
    )
    inner = attention.build("block_sparse", block_size=4, window=1)
    proj = 4 * 2 * 3 * 32 * 16 * 16
    assert module.flops(3, 32, 2, 8) == proj + inner.flops(3, 32, 2, 8)
    assert module.flops(3, 32, 2, 8, causal=True, backward=True) == 3 * proj + inner.flops(
        3, 32, 2, 8, causal=True, backward=True
    )
    with pytest.raises(ValueError, match=r"^num_heads, head_dim: this layer has 2 heads of 8"):
        module.flops(3, 32, 4, 4)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"embed_dim": 10, "num_heads": 3}, r"^params\.embed_dim: 10 must be divisible by"),
        ({"num_heads": 0}, r"^params\.num_heads: expected a positive integer"),
        ({"kernel": "nope"}, r"^params\.kernel: unknown or unsupported kernel 'nope'; valid: .*"),
        ({"kernel": "multihead"}, r"^params\.kernel: unknown or unsupported kernel 'multihead'"),
        ({"kernel": "dense", "kernel_params": {"x": 1}}, r"^params\.kernel_params\.x: unknown"),
        (
            {"kernel": "block_sparse", "kernel_params": {"block_size": 0}},
            r"^params\.kernel_params\.block_size: expected an integer",
        ),
        ({"bias": "yes"}, r"^params\.bias: "),
    ],
)
def test_invalid_parameters_raise_named_errors(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        attention.build("multihead", **params)


def test_shape_rules_come_from_the_inner_kernel_and_inputs_are_checked() -> None:
    inner = {"segment_lengths": [8], "dilation_rates": [2], "ordering": "hilbert"}
    params = {"kernel": "dilated", "kernel_params": inner}
    with pytest.raises(ValueError, match=r"^seq_len: 12 must be a power of 4"):
        attention.validate(
            "multihead", {**params, "embed_dim": 8, "num_heads": 2}, seq_len=12, num_heads=2
        )
    module = attention.build("multihead", embed_dim=8, num_heads=2)
    with pytest.raises(ValueError, match=r"^q: expected \(batch, seq, embed_dim=8\)"):
        module(torch.randn(1, 4, 2, 4))
    with pytest.raises(ValueError, match=r"^q, k, v: shapes must match"):
        module(torch.randn(1, 4, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8))


def test_shape_params_set_the_layer_from_the_run_and_refuse_contradictions() -> None:
    """embed_dim / num_heads come from the run's num_heads x head_dim; given ones must agree."""
    set_by_run = attention.shape_params("multihead", {"kernel": "dense"}, num_heads=2, head_dim=16)
    assert set_by_run == {"kernel": "dense", "embed_dim": 32, "num_heads": 2, "num_kv_heads": 2}
    agreeing = {"embed_dim": 32, "num_heads": 2, "num_kv_heads": 2}
    assert attention.shape_params("multihead", agreeing, num_heads=2, head_dim=16) == agreeing
    grouped = attention.shape_params("multihead", {}, num_heads=4, head_dim=8, num_kv_heads=2)
    assert grouped == {"embed_dim": 32, "num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ValueError, match=r"^params\.num_kv_heads: 4 contradicts .* 2"):
        attention.shape_params(
            "multihead", {"num_kv_heads": 4}, num_heads=4, head_dim=8, num_kv_heads=2
        )
    unset = {"embed_dim": None, "num_heads": None}  # what a sweep's normalized params hold
    assert attention.shape_params("multihead", unset, num_heads=4, head_dim=8) == {
        "embed_dim": 32,
        "num_heads": 4,
        "num_kv_heads": 4,
    }
    with pytest.raises(
        ValueError,
        match=r"^params\.embed_dim: 512 contradicts the run's num_heads x head_dim = 2 x 16 = 32",
    ):
        attention.shape_params("multihead", {"embed_dim": 512}, num_heads=2, head_dim=16)
    with pytest.raises(
        ValueError, match=r"^params\.num_heads: 4 contradicts the run's num_heads 2"
    ):
        attention.shape_params("multihead", {"num_heads": 4}, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"^params\.embed_dim: expected a positive integer"):
        attention.shape_params("multihead", {"embed_dim": "32"}, num_heads=2, head_dim=16)
    block = {"block_size": 4, "window": 1}
    assert attention.shape_params("block_sparse", block, num_heads=2, head_dim=16) == block


def test_the_layer_needs_its_shape_and_the_run_s_head_count() -> None:
    with pytest.raises(ValueError, match=r"^params\.embed_dim: not set"):
        attention.build("multihead", num_heads=2)
    with pytest.raises(ValueError, match=r"^params\.num_heads: not set"):
        attention.build("multihead", embed_dim=8)
    with pytest.raises(
        ValueError, match=r"^num_heads: the layer has params\.num_heads 2, the run 4"
    ):
        attention.validate("multihead", {"embed_dim": 8, "num_heads": 2}, seq_len=8, num_heads=4)
