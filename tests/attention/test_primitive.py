"""The (out, lse) primitive, merge and block backward against plain fp64 math."""

from __future__ import annotations

import functools
import itertools
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


def tril_keep(sq, sk, diagonal):
    """The explicit keep-mask of the primitive's causal convention: j <= i + diagonal."""
    return torch.ones(sq, sk, dtype=torch.bool).tril(diagonal)


SHAPES = [(sq, sk, d) for sq in (1, 4, 7) for sk in (1, 5, 7) for d in range(-8, 9)]


@pytest.mark.parametrize("sq,sk,diagonal", SHAPES)
def test_causal_pieces_cover_exactly_the_tril_mask(sq, sk, diagonal):
    """The pieces' union is tril(diagonal) with no pair twice; causal only on squares; two
    pieces' rows are equal or disjoint (block_forward merges equal ones)."""
    count = torch.zeros(sq, sk, dtype=torch.int64)
    pieces = primitive.causal_pieces(sq, sk, True, diagonal)
    for q0, q1, k0, k1, causal in pieces:
        assert 0 <= q0 < q1 <= sq and 0 <= k0 < k1 <= sk
        part = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
        if causal:
            assert q1 - q0 == k1 - k0
            part = part.tril()
        count[q0:q1, k0:k1] += part
    assert torch.equal(count, tril_keep(sq, sk, diagonal).long())
    rows = {p[:2] for p in pieces}
    assert all(a == b or a[1] <= b[0] or b[1] <= a[0] for a in rows for b in rows)
    assert len(pieces) <= (2 if sq + diagonal <= sk else 3)  # a third: rows that see every key
    assert primitive.causal_pieces(sq, sk, False) == ((0, sq, 0, sk, False),)
    with pytest.raises(ValueError, match="diagonal"):
        primitive.causal_pieces(sq, sk, False, 1)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize(
    "sq,sk,diagonal", [(6, 6, 0), (4, 9, 5), (4, 9, 2), (9, 4, 0), (6, 8, -2), (5, 7, -9)]
)
def test_offset_causal_forward_and_backward_equal_the_masked_reference(
    backend, sq, sk, diagonal, monkeypatch
):
    """Forward and gradients of causal=True, diagonal=d against fp64 attention under the explicit
    mask tril(d), empty rows (i < -d) included, on the fused CPU op and the plain-math path."""
    monkeypatch.setattr(primitive, "backend_for", lambda device, dtype: backend)
    q, k, v = rand(2, sq, 4, 8, seed=21), rand(2, sk, 2, 8, seed=22), rand(2, sk, 2, 8, seed=23)
    dout = rand(2, sq, 4, 8, seed=24)
    keep = tril_keep(sq, sk, diagonal)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(
        qd, kd.repeat_interleave(2, 2), vd.repeat_interleave(2, 2), 0.3, keep
    )
    ref_out.backward(dout.double())
    out, lse = block_forward(q, k, v, scale=0.3, causal=True, diagonal=diagonal)
    assert primitive.last_backend == backend
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    empty = ~keep.any(-1)
    assert torch.isneginf(lse[:, :, empty]).all() and (out[:, empty] == 0).all()
    grads = block_backward(dout, q, k, v, out, lse, scale=0.3, causal=True, diagonal=diagonal)
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad), strict=True):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


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
def test_block_backward_with_merged_lse_equals_autograd_of_whole(causal):
    """Two key blocks merged; each block's backward with the FINAL lse sums to the true
    gradient (causal: query i sees key j <= i + 2, so the second block's diagonal is 2 - 5)."""
    sq, sk = 6, 12
    q, k, v = rand(2, sq, 2, 4, seed=11), rand(2, sk, 2, 4, seed=12), rand(2, sk, 2, 4, seed=13)
    keep = tril_keep(sq, sk, 2) if causal else torch.ones(sq, sk, dtype=torch.bool)
    dout = rand(2, sq, 2, 4, seed=15)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(qd, kd, vd, 0.4, keep)
    ref_out.backward(dout.double())

    halves = [(slice(0, 5), 2), (slice(5, sk), 2 - 5)]
    out, lse = None, None
    for sl, d in halves:
        o, lse_b = block_forward(
            q, k[:, sl], v[:, sl], scale=0.4, causal=causal, diagonal=d * causal
        )
        out, lse = (o, lse_b) if out is None else merge(out, lse, o, lse_b)
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    dq = torch.zeros_like(q)
    for sl, d in halves:
        gq, gk, gv = block_backward(
            dout, q, k[:, sl], v[:, sl], out, lse, scale=0.4, causal=causal, diagonal=d * causal
        )
        dq += gq
        torch.testing.assert_close(gk.double(), kd.grad[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv.double(), vd.grad[:, sl], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.double(), qd.grad, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(dq).any()


def test_block_backward_causal_flag():
    q, k, v = rand(1, 6, 2, 4, seed=16), rand(1, 6, 2, 4, seed=17), rand(1, 6, 2, 4, seed=18)
    dout = rand(1, 6, 2, 4, seed=19)
    out, lse = block_forward(q, k, v, scale=0.5, causal=True)
    got = block_backward(dout, q, k, v, out, lse, scale=0.5, causal=True)
    want = primitive._math_backward(dout, q, k, v, out, lse, 0.5, True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_call_without_keys_is_empty_rows_not_a_crash():
    q, k = rand(1, 3, 2, 4), rand(1, 0, 2, 4)
    assert primitive.causal_pieces(3, 0, False) == ()
    out, lse = block_forward(q, k, k, scale=0.5)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = block_backward(q, q, k, k, out, lse, scale=0.5)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert all((g == 0).all() for g in grads)


def test_backend_choice_and_bad_shapes():
    assert backend_for("cpu", torch.float32) == "cpu_flash"
    assert backend_for("cuda", torch.bfloat16) == "cuda_flash"
    assert backend_for("cuda", torch.float32) == "cuda_efficient"
    assert backend_for("cuda", torch.float64) == "math"
    q = rand(1, 4, 1, 4)
    with pytest.raises(ValueError, match="q, k"):
        block_forward(q, rand(1, 4, 2, 4), rand(1, 4, 2, 4), scale=1.0)


@pytest.mark.parametrize(
    "dtype,backend", [(torch.bfloat16, "cuda_flash"), (torch.float32, "cuda_efficient")]
)
def test_cuda_backward_calls_bind_to_the_ops_schemas(dtype, backend):
    """The fused CUDA backward's calls, run on the meta device (PyTorch's shape kernels of the
    same ops), bind to their schemas and give back gradients in q's and k's shapes (GQA summed
    back to the kv heads). What only a GPU can check (lse and philox conventions, values) is
    tests/workers/test_cuda.py's and bench.gpu's."""
    meta = functools.partial(torch.randn, dtype=dtype, device="meta")
    q, dout, out = meta(2, 40, 4, 64), meta(2, 40, 4, 64), meta(2, 40, 4, 64, dtype=torch.float32)
    k, v, lse = meta(2, 48, 2, 64), meta(2, 48, 2, 64), meta(2, 4, 40, dtype=torch.float32)
    piece = (0, 40, 0, 48, True)
    dq, dk, dv = primitive._piece_backward(backend, dout, q, k, v, out, lse, 0.125, piece)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert {t.dtype for t in (dq, dk, dv)} == {torch.float32}
    op, args, _ = primitive._cuda_backward_args(backend, dout, q, k, v, out, lse, 0.125, True)
    named = dict(zip([a.name for a in op._schema.arguments], args, strict=False))
    kv_heads = 2 if backend == "cuda_flash" else 4  # flash: grouped heads as they are
    assert named["query"].shape == (2, 4, 40, 64)
    assert named["key"].shape == named["value"].shape == (2, kv_heads, 48, 64)
    assert named["out"].dtype == dtype  # the ops want out in the input dtype, not the fp32 merge
    lse_arg = named["logsumexp"]
    padded = 64 if backend == "cuda_efficient" else 40  # the efficient op's forward pads to 32s
    assert lse_arg.is_contiguous() and lse_arg.shape == (2, 4, padded)
    assert named["dropout_p"] == 0.0 and named["is_causal"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_cuda_ops_with_a_merged_lse_equal_the_reference(dtype, causal):
    """On a GPU: two key blocks merged, each block's fused backward fed the final (out, lse),
    against autograd of the float64 masked reference (bench.gpu's primitive check)."""
    from bench.gpu import primitive_check

    result = primitive_check(dtype, torch.device("cuda"), causal)
    assert result["backend"] == ("cuda_efficient" if dtype == "float32" else "cuda_flash")
    assert result["ok"], result


def test_token_chunks_are_near_equal_and_within_the_bound() -> None:
    assert primitive.token_chunks(0, 1024, 512) == [(0, 512), (512, 1024)]
    assert primitive.token_chunks(10, 17, 3) == [(10, 12), (12, 14), (14, 17)]
    assert primitive.token_chunks(0, 5, 8) == [(0, 5)]
    assert primitive.token_chunks(3, 3, 8) == []


def test_windows_split_only_inputs_narrower_than_their_accumulator() -> None:
    """fp32 and fp64 outputs are their own accumulators: one window. bf16 and fp16 rows are
    finished in ACCUMULATOR_WINDOWS equal windows of whole units, which cover the sequence."""
    assert primitive.windows(1000, torch.float32, 64) == [(0, 1000)]
    assert primitive.windows(1000, torch.float64) == [(0, 1000)]
    assert primitive.windows(0, torch.bfloat16) == []
    assert primitive.windows(8, torch.bfloat16, 64) == [(0, 8)]
    for seq, unit in [(1000, 64), (1024, 1), (17, 1), (16384, 128), (100, 3)]:
        spans = primitive.windows(seq, torch.bfloat16, unit)
        assert spans[0][0] == 0 and spans[-1][1] == seq
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        sizes = {c1 - c0 for c0, c1 in spans[:-1]}
        assert len(sizes) <= 1 and all(size % unit == 0 for size in sizes)
        assert len(spans) <= primitive.ACCUMULATOR_WINDOWS
    assert len(primitive.windows(16384, torch.float16, 128)) == primitive.ACCUMULATOR_WINDOWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_result_fills_each_window_once_and_casts_it(dtype) -> None:
    """Each window's fill sees fresh accumulators (0, -inf) for its own rows, row c0 first;
    what it leaves there is the output (in q's dtype) and lse of those rows."""
    q = rand(2, 40, 3, 4).to(dtype)
    seen = []

    def fill(c0: int, c1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        assert out.shape == (2, c1 - c0, 3, 4) and lse.shape == (2, 3, c1 - c0)
        assert out.dtype == lse.dtype == torch.float32
        assert (out == 0).all() and torch.isneginf(lse).all()
        seen.append((c0, c1))
        positions = torch.arange(c0, c1, dtype=torch.float32)
        out.copy_(positions[None, :, None, None].expand_as(out))
        lse.copy_(-positions.expand_as(lse))

    out, lse = primitive.windowed_result(q, fill, primitive.windows(40, dtype, 3))
    assert seen == primitive.windows(40, dtype, 3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    positions = torch.arange(40, dtype=torch.float32)
    assert torch.equal(out.float(), positions[None, :, None, None].expand(2, 40, 3, 4))
    assert torch.equal(lse, -positions.expand(2, 3, 40))


def test_a_bf16_call_of_several_pieces_merges_them_in_fp32() -> None:
    """A causal call with a diagonal cuts into a rectangle and a causal square that are merged
    inside block_forward: that merge is in fp32 (out comes back fp32, equal to the fp32 inputs'
    result up to the pieces' bf16 roundings); a single fused call's out comes back as the op
    made it (bf16)."""
    q, k, v = (rand(1, 48, 2, 8, seed=s).bfloat16() for s in (1, 2, 3))
    out, lse = block_forward(q, k, v, scale=0.3, causal=True, diagonal=16)
    ref, ref_lse = block_forward(
        q.float(), k.float(), v.float(), scale=0.3, causal=True, diagonal=16
    )
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=0)  # bf16 pieces: their roundings only
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=0)
    single, _ = block_forward(q, k, v, scale=0.3)
    assert single.dtype == torch.bfloat16
