"""`dilated` (LongNet) against a dense reference built from explicit per-branch token masks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attention
from attention import dilated as dilated_module
from attention.dilated import DilatedAttention, DilatedParams
from attention.masks import dilated_branch_mask, dilated_reference

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-5


def _inputs(batch: int, seq: int, heads: int, dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def assert_matches_reference(module, reference, batch, seq, heads, dim, causal, seed=0) -> None:
    """out and dq, dk, dv of the fp32 kernel equal the fp64 reference within 1e-5."""
    q64, k64, v64 = (t.requires_grad_() for t in _inputs(batch, seq, heads, dim, seed))
    q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
    out = module(q, k, v, causal=causal)
    g = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    key = (reference, batch, seq, heads, dim, causal, seed)
    if isinstance(reference, DilatedRef) and key in _REFERENCE_CACHE:
        ref, refs = _REFERENCE_CACHE[key]
    else:
        ref = reference(q64, k64, v64, causal)
        refs = torch.autograd.grad(ref, (q64, k64, v64), g)
        ref = ref.detach()
        if isinstance(reference, DilatedRef):
            _REFERENCE_CACHE[key] = (ref, refs)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=ATOL)
    grads = torch.autograd.grad(out, (q, k, v), g.float())
    for name, a, b in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(a.double(), b, atol=ATOL, rtol=ATOL, msg=f"d{name}")


@dataclass(frozen=True)
class DilatedRef:
    """The fp64 LongNet reference for one (segment_lengths, dilation_rates): hashable, so the
    reference of a shape is computed once for both plans (and windows) of the kernel."""

    ws: tuple[int, ...]
    rs: tuple[int, ...]

    def __call__(self, q, k, v, causal):
        return dilated_reference(q, k, v, self.ws, self.rs, causal=causal)


_REFERENCE_CACHE: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
"""(reference, batch, seq, heads, dim, causal, seed) -> the reference's output and grads."""


def _dilated_ref(ws, rs):
    return DilatedRef(tuple(ws), tuple(rs))


CONFIGS = [
    # (seq, heads, segment_lengths, dilation_rates)
    (16, 3, (4, 8), (1, 2)),  # H=3, r=2: groups of 2 and 1 heads
    (16, 5, (8, 16), (4, 2)),  # H=5, r=4: groups of 2, 2, 1; offset 3 has no heads
    (24, 4, (6, 12, 24), (1, 2, 3)),
    (32, 2, (8, 16, 32), (1, 2, 4)),  # r > H: some offsets uncovered in a branch
    (16, 6, (16,), (4,)),  # one branch: positions/heads outside a group are uncovered -> 0
    (12, 3, (4, 12), (2, 3)),  # no r=1 branch
    # Lengths that do not divide (module docstring): w % r != 0, seq % w != 0, w > seq.
    (16, 4, (6,), (4,)),  # segments of 6: offsets 0, 1 keep 2 rows, 2, 3 keep 1; tail of 4
    (20, 6, (8, 12, 32), (1, 6, 4)),  # 12 % 6 == 0 but 20 % 12 != 0; w = 32 > seq
    (13, 5, (3, 5, 7), (2, 3, 4)),  # nothing divides anything
]
PLANS = ["cpu", "cuda"]
"""Both plans of the kernel, the cuda plan forced on CPU: every correctness test runs each."""
PAPER = ((64, 128, 256, 512, 1024), (1, 2, 4, 6, 12))
"""LongNet's configuration (w = 2048..32768, r = 1, 2, 4, 6, 12) scaled to CPU by 1/32."""


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seq", "heads", "ws", "rs"), CONFIGS)
@pytest.mark.parametrize("plan", PLANS)
def test_dilated_matches_masked_reference(plan, seq, heads, ws, rs, causal) -> None:
    module = attention.build("dilated", plan=plan, segment_lengths=ws, dilation_rates=rs)
    assert_matches_reference(module, _dilated_ref(ws, rs), 2, seq, heads, 8, causal)


@pytest.mark.parametrize("seq", [700, 1100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("plan", PLANS)
def test_the_papers_configuration_matches_the_reference(plan, seq, causal) -> None:
    """The paper's rates on lengths below the largest segment (700: one shrunk segment) and
    above it (1100: a segment of 1024 and a tail of 76); w = 256, 512 do not divide by 6, 12."""
    module = attention.build(
        "dilated", plan=plan, segment_lengths=PAPER[0], dilation_rates=PAPER[1]
    )
    assert_matches_reference(module, _dilated_ref(*PAPER), 1, seq, 12, 4, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("units", [1, 3, 5])
@pytest.mark.parametrize(("seq", "heads", "ws", "rs"), CONFIGS)
def test_windows_that_cut_segments_match_the_reference(
    seq, heads, ws, rs, units, causal, accumulator_windows
) -> None:
    """The forward in accumulator windows (how bf16 and fp16 run it, forced here for fp32):
    windows of 1, 3 and 5 tokens cut segments, so each cut segment's queries inside a window
    run against all of its keys (causal: those up to the window's last query)."""
    accumulator_windows(units)
    module = attention.build("dilated", segment_lengths=ws, dilation_rates=rs)
    assert_matches_reference(module, _dilated_ref(ws, rs), 2, seq, heads, 8, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_the_papers_configuration_in_windows_matches_the_reference(
    causal, accumulator_windows
) -> None:
    """Windows of 37 tokens across segments of 64..300 tokens (512 and 1024 shrunk to 300)."""
    accumulator_windows(37)
    module = attention.build("dilated", segment_lengths=PAPER[0], dilation_rates=PAPER[1])
    assert_matches_reference(module, _dilated_ref(*PAPER), 1, 300, 12, 4, causal)


@pytest.mark.parametrize("plan", PLANS)
def test_zero_padding_at_the_end_changes_no_causal_output(plan) -> None:
    """Causally, padding the sequence to a multiple of every segment (torchscale's convention)
    gives the same outputs on the real tokens: the conventions agree there."""
    ws, rs = (6, 10), (4, 3)
    module = attention.build("dilated", plan=plan, segment_lengths=ws, dilation_rates=rs)
    q, k, v = (t.float() for t in _inputs(1, 23, 4, 8, seed=7))
    padded = [torch.cat([t, torch.zeros(1, 7, 4, 8)], dim=1) for t in (q, k, v)]
    torch.testing.assert_close(module(*padded, causal=True)[:, :23], module(q, k, v, causal=True))


@pytest.mark.parametrize("plan", PLANS)
def test_fp64_inputs_keep_fp64_accuracy(plan) -> None:
    """fp64 in, fp64 accumulators: agreement with the fp64 reference far below fp32's 1e-7."""
    ws, rs = (8, 16), (1, 2)
    q, k, v = _inputs(1, 32, 3, 8, seed=11)
    out = attention.build("dilated", plan=plan, segment_lengths=ws, dilation_rates=rs)(q, k, v)
    assert out.dtype == torch.float64
    ref = dilated_reference(q, k, v, ws, rs)
    assert (out - ref).abs().max().item() < 1e-12


def test_branch_mask_follows_the_authors_head_groups() -> None:
    # H=3, r=2: ceil(3/2)=2 heads per group; heads 0,1 keep even offsets, head 2 odd ones.
    keep = dilated_branch_mask(8, 3, 4, 2)
    kept_rows = keep.any(-1)
    assert kept_rows[0].tolist() == [True, False] * 4
    assert kept_rows[1].tolist() == [True, False] * 4
    assert kept_rows[2].tolist() == [False, True] * 4
    assert keep[0, 0].tolist() == [True, False, True, False, False, False, False, False]
    assert keep[2, 5].tolist() == [False, False, False, False, False, True, False, True]
    causal = dilated_branch_mask(8, 3, 4, 2, causal=True)
    assert causal[2, 5].tolist() == [False] * 5 + [True, False, False]


@pytest.mark.parametrize("plan", PLANS)
def test_uncovered_positions_output_zero_and_get_no_gradient(plan) -> None:
    module = attention.build("dilated", plan=plan, segment_lengths=(8,), dilation_rates=(2,))
    q, k, v = (t.float().requires_grad_() for t in _inputs(1, 16, 1, 4, seed=3))
    out = module(q, k, v)
    assert (out[:, 1::2] == 0).all() and (out[:, 0::2] != 0).any()
    out.sum().backward()
    assert (q.grad[:, 1::2] == 0).all() and (k.grad[:, 1::2] == 0).all()


@pytest.mark.parametrize("plan", PLANS)
def test_hilbert_ordering_equals_reference_on_permuted_positions(plan) -> None:
    from attention.hilbert import hilbert_permutation

    ws, rs = (4, 16), (1, 2)
    perm = hilbert_permutation(16)
    inv = torch.argsort(perm)

    def reference(q, k, v, causal):
        out = dilated_reference(q[:, perm], k[:, perm], v[:, perm], ws, rs, causal=causal)
        return out[:, inv]

    module = attention.build(
        "dilated", plan=plan, segment_lengths=ws, dilation_rates=rs, ordering="hilbert"
    )
    for causal in (False, True):
        assert_matches_reference(module, reference, 2, 16, 3, 8, causal)


def test_primitive_calls_cover_exactly_the_counted_pairs(monkeypatch) -> None:
    """The kernel computes only the dilated rows: pairs passed to the primitive == flops()."""
    seen = []
    real = dilated_module.block_forward

    def spy(q, k, v, **kw):
        sq, sk = q.shape[1], k.shape[1]
        seen.append(q.shape[0] * q.shape[2] * (sq * (sq + 1) // 2 if kw["causal"] else sq * sk))
        return real(q, k, v, **kw)

    monkeypatch.setattr(dilated_module, "block_forward", spy)
    module = attention.build("dilated", segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4))
    q, k, v = (t.float() for t in _inputs(2, 32, 5, 4, seed=5))
    for causal in (False, True):
        seen.clear()
        module(q, k, v, causal=causal)
        assert 4 * 4 * sum(seen) == module.flops(2, 32, 5, 4, causal=causal)


def test_flops_count_segments_of_dilated_rows() -> None:
    module = attention.build("dilated", segment_lengths=(4, 8), dilation_rates=(1, 2))
    # per head: 4 segments x 4^2 + 2 segments x 4^2 = 96 pairs; causal: 4 x 10 + 2 x 10 = 60
    assert module.flops(2, 16, 3, 8) == 4 * 8 * 2 * 3 * 96
    assert module.flops(2, 16, 3, 8, causal=True) == 4 * 8 * 2 * 3 * 60
    assert module.flops(1, 16, 1, 8, backward=True) == int(4 * 8 * 96 * 3.5)
    dense = attention.build("dense").flops(1, 16384, 8, 64)
    longnet = attention.build("dilated").flops(1, 16384, 8, 64)
    assert longnet / dense == pytest.approx(14 * 2048**2 / 16384**2)


@pytest.mark.parametrize("plan", PLANS)
def test_low_precision_input_gives_output_of_that_dtype(plan) -> None:
    module = attention.build("dilated", plan=plan, segment_lengths=(4, 8), dilation_rates=(1, 2))
    q, k, v = (t.float() for t in _inputs(1, 16, 2, 8, seed=7))
    out32 = module(q, k, v)
    out16 = module(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out16.dtype == torch.bfloat16 and out16.shape == q.shape
    torch.testing.assert_close(out16.float(), out32, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(
    ("params", "seq_len", "match"),
    [
        ({"segment_lengths": (), "dilation_rates": ()}, 16, r"^params\.segment_lengths: must not"),
        ({"segment_lengths": (4, 8), "dilation_rates": (1,)}, 16, r"^params\.dilation_rates: "),
        ({"segment_lengths": (4,), "dilation_rates": (0,)}, 16, r"^params\.dilation_rates: "),
        ({"segment_lengths": 4, "dilation_rates": (1,)}, 16, r"^params\.segment_lengths: "),
        ({"segment_lengths": (4,), "dilation_rates": (1,), "ordering": "zorder"}, 16, "ordering"),
        ({"segment_lengths": (4,), "dilation_rates": (1,), "plan": "gpu"}, 16, r"^params\.plan: "),
        ({"segment_lengths": (4,), "dilation_rates": (1,), "ordering": "hilbert"}, 32, "^seq_len"),
    ],
)
def test_invalid_configurations_raise_named_errors(params, seq_len, match) -> None:
    with pytest.raises(ValueError, match=match):
        attention.validate("dilated", params, seq_len=seq_len)
    if not match.startswith("^seq_len"):
        with pytest.raises(ValueError, match=match):
            attention.build("dilated", **params)
    else:
        module = attention.build("dilated", **params)
        with pytest.raises(ValueError, match=match):
            module(*(torch.zeros(1, seq_len, 1, 4) for _ in range(3)))


def test_the_plan_that_ran_is_in_the_backend_and_auto_follows_the_device() -> None:
    """auto on CPU runs the cpu plan; a forced plan runs as asked; a meta tensor standing for
    CUDA (bench.plan) resolves auto to the cuda plan and the CUDA op's backend."""
    from attention.primitive import meta_stands_for

    q = torch.randn(1, 16, 2, 8)
    for plan, ran in (("auto", "cpu"), ("cpu", "cpu"), ("cuda", "cuda")):
        module = attention.build(
            "dilated", segment_lengths=(4, 8), dilation_rates=(1, 2), plan=plan
        )
        module(q, q, q)
        assert (module.plan, module.backend) == (ran, f"cpu_flash/plan-{ran}")
    meta = q.to("meta", torch.bfloat16)
    module = attention.build("dilated", segment_lengths=(4, 8), dilation_rates=(1, 2))
    with meta_stands_for("cuda"):
        assert module(meta, meta, meta).device.type == "meta"
    assert module.backend == "cuda_flash/plan-cuda"


def test_lists_from_json_become_tuples() -> None:
    params = attention.make_params("dilated", {"segment_lengths": [4, 8], "dilation_rates": [1, 2]})
    assert params == DilatedParams((4, 8), (1, 2))
    assert isinstance(DilatedAttention(params).params.segment_lengths, tuple)


@st.composite
def dilated_configs(draw):
    n_branches = draw(st.integers(1, 3))
    base = draw(st.sampled_from([2, 3, 4]))
    ws, rs = [], []
    for _ in range(n_branches):
        w = base * draw(st.sampled_from([1, 2, 4]))
        rs.append(draw(st.sampled_from([1, 2, 3, 4, 6])))
        ws.append(w)
    seq = draw(st.integers(1, 2 * max(ws)))  # any length: tails and segments longer than it
    return seq, draw(st.integers(1, 5)), tuple(ws), tuple(rs), draw(st.booleans())


@pytest.mark.parametrize("plan", PLANS)
@settings(max_examples=25, deadline=None)
@given(config=dilated_configs(), batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_property_random_valid_configs_match_reference(plan, config, batch, seed) -> None:
    seq, heads, ws, rs, causal = config
    module = attention.build("dilated", plan=plan, segment_lengths=ws, dilation_rates=rs)
    assert_matches_reference(module, _dilated_ref(ws, rs), batch, seq, heads, 4, causal, seed)


@pytest.mark.parametrize("causal", [False, True])
def test_small_chunks_give_the_same_result(causal, monkeypatch) -> None:
    monkeypatch.setattr(dilated_module, "CHUNK_TOKENS", 4)
    ws, rs = (4, 8, 16), (1, 2, 4)
    module = attention.build("dilated", segment_lengths=ws, dilation_rates=rs)
    assert_matches_reference(module, _dilated_ref(ws, rs), 2, 32, 5, 4, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("seq", "heads", "ws", "rs"), [(32, 5, (4, 8, 16), (1, 2, 4)), CONFIGS[-1]]
)
def test_small_backward_parts_give_the_same_gradients(seq, heads, ws, rs, causal, monkeypatch):
    """Query and key parts of 3 and 2 rows, one segment and head a call: parts straddle or lie
    below the causal diagonal, and the gradients still equal the reference's."""
    monkeypatch.setattr(dilated_module, "BACKWARD_QUERY_TOKENS", 3)
    monkeypatch.setattr(dilated_module, "BACKWARD_KEY_TOKENS", 2)
    monkeypatch.setattr(dilated_module, "BACKWARD_ROW_HEADS", 1)
    module = attention.build("dilated", segment_lengths=ws, dilation_rates=rs)
    assert_matches_reference(module, _dilated_ref(ws, rs), 2, seq, heads, 4, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_calls_cover_the_counted_pairs_within_the_bounds(causal, monkeypatch) -> None:
    """The backward's calls see exactly the forward's pairs (flops()), each call within the
    query, key and rows x heads bounds."""
    monkeypatch.setattr(dilated_module, "BACKWARD_QUERY_TOKENS", 5)
    monkeypatch.setattr(dilated_module, "BACKWARD_KEY_TOKENS", 3)
    monkeypatch.setattr(dilated_module, "BACKWARD_ROW_HEADS", 40)
    seen, real = [], dilated_module.block_backward

    def spy(dout, q, k, v, out, lse, **kw):
        count, sq, heads, _ = q.shape
        sk, diag = k.shape[1], kw["diagonal"]
        assert kw["causal"] == causal and sq <= 5 and sk <= 3
        assert count * heads * (2 * sq + 2 * sk) <= 40
        per_head = sum(min(sk, max(0, i + diag + 1)) for i in range(sq)) if causal else sq * sk
        assert per_head > 0  # a key part that no query of its part sees is not called
        seen.append(count * heads * per_head)
        return real(dout, q, k, v, out, lse, **kw)

    monkeypatch.setattr(dilated_module, "block_backward", spy)
    module = attention.build("dilated", segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4))
    q, k, v = (t.float().requires_grad_() for t in _inputs(2, 32, 5, 4, seed=5))
    out = module(q, k, v, causal=causal)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert 4 * 4 * sum(seen) == module.flops(2, 32, 5, 4, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_cuda_plan_is_as_close_to_float64_as_the_cpu_plan(causal) -> None:
    """The cuda plan merges bf16 outputs and sums bf16 gradients in bf16 (one rounding per
    branch, as torchscale) where the cpu plan keeps fp32 windows and accumulators: against the
    float64 reference, its output and gradients stay within twice the cpu plan's error (and
    within bf16's few ulps)."""
    ws, rs = PAPER[0][:3], PAPER[1][:3]
    q64, k64, v64 = (t.requires_grad_() for t in _inputs(1, 300, 12, 8, seed=5))
    ref = dilated_reference(q64, k64, v64, ws, rs, causal=causal)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    refs = [ref, *torch.autograd.grad(ref, (q64, k64, v64), g)]
    errors = {}
    for plan in PLANS:
        q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q64, k64, v64))
        module = attention.build("dilated", segment_lengths=ws, dilation_rates=rs, plan=plan)
        out = module(q, k, v, causal=causal)
        got = [out, *torch.autograd.grad(out, (q, k, v), g.bfloat16())]
        errors[plan] = [(a.double() - b).abs().max().item() for a, b in zip(got, refs, strict=True)]
    for cuda, cpu, r in zip(errors["cuda"], errors["cpu"], refs, strict=True):
        assert cuda <= 2 * cpu and cuda <= 0.02 * r.abs().max().item()
