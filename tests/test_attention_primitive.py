"""The (out, lse) primitive, merge and block backward against plain fp64 math."""

from __future__ import annotations

import math

import pytest
import torch

from attention import primitive
from attention.primitive import backend_for, block_backward, block_forward, merge

pytestmark = pytest.mark.timeout(60)


def reference(q, k, v, scale, keep):
    """Plain fp64 masked attention: out (B,Sq,H,D), lse (B,H,Sq); empty rows give 0 and -inf."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = (qd @ kd.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), math.inf).unsqueeze(-1))
    return (probs @ vd).transpose(1, 2), lse


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 5)])
def test_block_forward_matches_math_natural_log_lse(causal, sq, sk):
    q, k, v = rand(2, sq, 3, 8, seed=1), rand(2, sk, 3, 8, seed=2), rand(2, sk, 3, 8, seed=3)
    out, lse = block_forward(q, k, v, scale=0.3, causal=causal)
    assert primitive.last_backend == "cpu_flash"
    keep = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else None
    ref_out, ref_lse = reference(q, k, v, 0.3, keep)
    assert out.dtype == torch.float32 and out.shape == (2, sq, 3, 8)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, sq)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_head", [False, True])
def test_block_forward_mask_and_empty_rows(per_head):
    q, k, v = rand(1, 6, 2, 4, seed=4), rand(1, 8, 2, 4, seed=5), rand(1, 8, 2, 4, seed=6)
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(2 if per_head else 1, 6, 8, generator=g) > 0.5
    keep[..., 0, :] = False  # an empty row
    if not per_head:
        keep = keep[0]
    out, lse = block_forward(q, k, v, scale=0.5, mask=keep)
    ref_out, ref_lse = reference(q, k, v, 0.5, keep)
    assert torch.isneginf(lse[:, :, 0]).all()
    assert (out[:, 0] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    math_out, math_lse = primitive._math_forward(q, k, v, 0.5, keep)
    torch.testing.assert_close(math_out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(math_lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_two_key_halves_equals_whole_and_is_nan_free():
    q, k, v = rand(1, 5, 2, 4, seed=8), rand(1, 10, 2, 4, seed=9), rand(1, 10, 2, 4, seed=10)
    oa, la = block_forward(q, k[:, :4], v[:, :4], scale=0.5)
    ob, lb = block_forward(q, k[:, 4:], v[:, 4:], scale=0.5)
    out, lse = merge(oa, la, ob, lb)
    ref_out, ref_lse = reference(q, k, v, 0.5, None)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    empty_o, empty_l = torch.zeros_like(oa), torch.full_like(la, float("-inf"))
    o1, l1 = merge(empty_o, empty_l, oa, la)
    torch.testing.assert_close(o1, oa)
    torch.testing.assert_close(l1, la)
    o2, l2 = merge(empty_o, empty_l, empty_o, empty_l)
    assert not torch.isnan(o2).any() and (o2 == 0).all() and torch.isneginf(l2).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_mask", [False, True])
def test_block_backward_with_merged_lse_equals_autograd_of_whole(causal, use_mask):
    """Two key blocks merged; each block's backward with the FINAL lse sums to the true gradient."""
    sq, sk = 6, 12
    q, k, v = rand(2, sq, 2, 4, seed=11), rand(2, sk, 2, 4, seed=12), rand(2, sk, 2, 4, seed=13)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if use_mask:
        keep = torch.rand(sq, sk, generator=torch.Generator().manual_seed(14)) > 0.4
        keep[1] = False
    if causal:
        keep = keep & torch.ones(sq, sk, dtype=torch.bool).tril()
    dout = rand(2, sq, 2, 4, seed=15)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(qd, kd, vd, 0.4, keep)
    ref_out.backward(dout.double())

    halves = [(slice(0, 5), keep[:, :5]), (slice(5, sk), keep[:, 5:])]
    out, lse = None, None
    for sl, m in halves:
        o, lse_b = block_forward(q, k[:, sl], v[:, sl], scale=0.4, mask=m)
        out, lse = (o, lse_b) if out is None else merge(out, lse, o, lse_b)
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    dq = torch.zeros_like(q)
    for sl, m in halves:
        gq, gk, gv = block_backward(dout, q, k[:, sl], v[:, sl], out, lse, scale=0.4, mask=m)
        dq += gq
        torch.testing.assert_close(gk.double(), kd.grad[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv.double(), vd.grad[:, sl], atol=1e-5, rtol=1e-5)
        mq, mk, mv = primitive._math_backward(dout, q, k[:, sl], v[:, sl], out, lse, 0.4, m)
        torch.testing.assert_close(mq, gq, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mk.double(), kd.grad[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mv.double(), vd.grad[:, sl], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.double(), qd.grad, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(dq).any()


def test_block_backward_causal_flag():
    q, k, v = rand(1, 6, 2, 4, seed=16), rand(1, 6, 2, 4, seed=17), rand(1, 6, 2, 4, seed=18)
    dout = rand(1, 6, 2, 4, seed=19)
    out, lse = block_forward(q, k, v, scale=0.5, causal=True)
    got = block_backward(dout, q, k, v, out, lse, scale=0.5, causal=True)
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    want = primitive._math_backward(dout, q, k, v, out, lse, 0.5, keep)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_backend_choice_and_bad_mask():
    assert backend_for("cpu", torch.float32) == "cpu_flash"
    assert backend_for("cpu", torch.float32, has_mask=True) == "cpu_flash"
    assert backend_for("cuda", torch.bfloat16) == "cuda_flash"
    assert backend_for("cuda", torch.float32) == "cuda_efficient"
    assert backend_for("cuda", torch.bfloat16, has_mask=True) == "math"
    q = rand(1, 4, 1, 4)
    with pytest.raises(ValueError, match="mask"):
        block_forward(q, q, q, scale=1.0, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="q, k"):
        block_forward(q, rand(1, 4, 2, 4), rand(1, 4, 2, 4), scale=1.0)
