"""`block_sparse` against dense attention restricted to an explicit token mask; its patterns."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attention
from attention import block_sparse as bs_module
from attention.block_sparse import backward as bs_backward
from attention.block_sparse import cpu_plan as bs_plan
from attention.block_sparse import forward as bs_forward
from attention.hilbert import hilbert_permutation
from attention.masks import block_token_mask, masked_attention

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-5


def _patch(monkeypatch, name: str, value) -> None:
    """Set `name` in every module of the block_sparse package that binds it: each module reads
    its own binding of a name it imports from another (SUPERBLOCK_TOKENS: forward and backward)."""
    modules = (bs_module, bs_plan, bs_forward, bs_backward)
    holders = [module for module in modules if hasattr(module, name)]
    assert holders, name
    for module in holders:
        monkeypatch.setattr(module, name, value)


def assert_matches_reference(module, keep_fn, batch, seq, heads, dim, causal, seed=0) -> None:
    """out and dq, dk, dv of the fp32 kernel equal fp64 masked attention within 1e-5.

    keep_fn(q, k, v, causal) -> reference output (fp64, autograd).
    """
    g = torch.Generator().manual_seed(seed)
    q64, k64, v64 = (
        torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
    out = module(q, k, v, causal=causal)
    ref = keep_fn(q64, k64, v64, causal)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=ATOL)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout.float())
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout)
    for name, a, b in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(a.double(), b, atol=ATOL, rtol=ATOL, msg=f"d{name}")


def _explicit_block_mask(pattern: str, n: int, **p) -> torch.Tensor:
    """The patterns' definitions written as loops over (query block i, key block j)."""
    keep = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            d = abs(i - j)
            if pattern == "local_window":
                keep[i, j] = d <= p["window"]
            elif pattern == "dilated":
                keep[i, j] = d % p["dilation"] == 0 and d <= p["window"] * p["dilation"]
            elif pattern == "global_local":
                g = p["num_global"]
                keep[i, j] = d <= p["window"] or i < g or j < g
    return keep


def _reference(module, block_size):
    def reference(q, k, v, causal):
        seq = q.shape[1]
        keep = block_token_mask(module.block_mask(seq), block_size, causal=causal, seq_len=seq)
        return masked_attention(q, k, v, keep)[0]

    return reference


PARAMS = [
    {"block_size": 4, "pattern": "local_window", "window": 1},
    {"block_size": 2, "pattern": "local_window", "sparsity_ratio": 0.25},
    {"block_size": 4, "pattern": "dilated", "window": 2, "dilation": 2},
    {"block_size": 2, "pattern": "dilated", "sparsity_ratio": 0.2, "dilation": 3},
    {"block_size": 4, "pattern": "global_local", "window": 0, "num_global": 1},
    {"block_size": 2, "pattern": "global_local", "sparsity_ratio": 0.4, "num_global": 2},
    {"block_size": 4, "pattern": "random", "num_random": 2, "seed": 1},
    {"block_size": 2, "pattern": "random", "sparsity_ratio": 0.3, "seed": 7},
]
BOTH_PLANS_PARAMS = [
    *PARAMS,
    {"block_size": 4, "pattern": "global_local", "window": 3, "num_global": 4},
]
"""PARAMS and global_local whose global blocks the window's end cuts (partial tiles inside the
global rows and columns), for the tests run under both plans."""


PLANS = ["cpu", "cuda"]
"""Both execution plans, on CPU (the CUDA plan forced: the CPU flash op in its call structure)."""


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("params", BOTH_PLANS_PARAMS, ids=lambda p: "-".join(map(str, p.values())))
def test_block_sparse_matches_masked_reference(params, causal, plan) -> None:
    module = attention.build("block_sparse", plan=plan, **params)
    assert_matches_reference(module, _reference(module, params["block_size"]), 2, 32, 3, 8, causal)


@pytest.mark.parametrize(
    ("pattern", "p"),
    [
        ("local_window", {"window": 0}),
        ("local_window", {"window": 2}),
        ("dilated", {"window": 1, "dilation": 3}),
        ("dilated", {"window": 3, "dilation": 2}),
        ("global_local", {"window": 1, "num_global": 2}),
    ],
)
def test_block_masks_follow_the_pattern_definitions(pattern, p) -> None:
    module = attention.build("block_sparse", block_size=2, pattern=pattern, **p)
    mask = module.block_mask(24)
    assert mask.dtype == torch.bool and mask.shape == (12, 12)
    defaults = {"dilation": 2, "num_global": 1}
    assert torch.equal(mask, _explicit_block_mask(pattern, 12, **{**defaults, **p}))
    assert torch.equal(module.block_mask(24, causal=True), mask.tril())


def test_random_pattern_keeps_diagonal_and_exact_count_per_row_and_is_seeded() -> None:
    make = lambda seed: attention.build(  # noqa: E731
        "block_sparse", block_size=1, pattern="random", num_random=3, seed=seed
    )
    mask = make(5).block_mask(16)
    assert mask.diagonal().all() and (mask.sum(-1) == 4).all()
    assert torch.equal(mask, make(5).block_mask(16))
    assert not torch.equal(mask, make(6).block_mask(16))


@pytest.mark.parametrize("pattern", ["local_window", "dilated", "global_local", "random"])
def test_sparsity_ratio_sets_density_within_one_block_per_row(pattern) -> None:
    n = 64
    densities = []
    for ratio in (0.1, 0.25, 0.5):
        extra = {"dilation": 1} if pattern == "dilated" else {}
        module = attention.build(
            "block_sparse", block_size=1, pattern=pattern, sparsity_ratio=ratio, **extra
        )
        mask = module.block_mask(n)
        density = mask.float().mean().item()
        assert abs(density - ratio) <= 1 / n, (ratio, density)
        assert mask.diagonal().all()
        densities.append(density)
    assert densities[0] < densities[1] < densities[2]


def _spy_pairs(monkeypatch, name: str) -> list[tuple[int, int]]:
    """Patch <name> (block_forward or block_backward) to record, per primitive call,
    (query tokens, kept token pairs x batch x heads)."""
    calls: list[tuple[int, int]] = []
    real = getattr(bs_forward if name == "block_forward" else bs_backward, name)
    at = 0 if name == "block_forward" else 1  # the backward's q comes after dout

    def spy(*args, causal=False, diagonal=0, **kwargs):
        q, k = args[at], args[at + 1]
        sq, sk = q.shape[1], k.shape[1]
        kept = int(torch.ones(sq, sk).tril(diagonal).sum()) if causal else sq * sk
        calls.append((sq, q.shape[0] * q.shape[2] * kept))
        return real(*args, causal=causal, diagonal=diagonal, **kwargs)

    _patch(monkeypatch, name, spy)
    return calls


def test_kernel_computes_exactly_the_kept_pairs(monkeypatch) -> None:
    """Token pairs the primitive is asked to keep == mask count == flops(); no dense compute."""
    seen = _spy_pairs(monkeypatch, "block_forward")
    for params in PARAMS:
        module = attention.build("block_sparse", **params)
        q = torch.randn(2, 32, 3, 4)
        for causal in (False, True):
            seen.clear()
            module(q, q, q, causal=causal)
            token_keep = block_token_mask(
                module.block_mask(32), params["block_size"], causal=causal
            )
            pairs = sum(p for _, p in seen)
            assert pairs == 2 * 3 * int(token_keep.sum())
            assert module.flops(2, 32, 3, 4, causal=causal) == 4 * 4 * pairs


def test_flops_count_kept_blocks() -> None:
    module = attention.build("block_sparse", block_size=4, pattern="local_window", window=1)
    # 8 blocks: 8 diagonal + 14 off-diagonal kept blocks of 16 pairs; causal: 7 below + 8 x 10
    assert module.flops(1, 32, 2, 8) == 4 * 8 * 2 * (22 * 16)
    assert module.flops(1, 32, 2, 8, causal=True) == 4 * 8 * 2 * (7 * 16 + 8 * 10)


@pytest.mark.parametrize("plan", PLANS)
def test_hilbert_ordering_equals_reference_on_permuted_positions(plan) -> None:
    params = {"block_size": 4, "pattern": "local_window", "window": 1, "ordering": "hilbert"}
    params["plan"] = plan
    module = attention.build("block_sparse", **params)
    perm = hilbert_permutation(64)
    inv = torch.argsort(perm)

    def reference(q, k, v, causal):
        keep = block_token_mask(module.block_mask(64), 4, causal=causal)
        return masked_attention(q[:, perm], k[:, perm], v[:, perm], keep)[0][:, inv]

    for causal in (False, True):
        assert_matches_reference(module, reference, 2, 64, 2, 4, causal)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"block_size": 0, "window": 1}, r"^params\.block_size: "),
        ({"pattern": "banded", "window": 1}, r"^params\.pattern: must be one of"),
        ({"sparsity_ratio": 0.25, "window": 2}, r"^params\.window: conflicts with"),
        ({"pattern": "random", "sparsity_ratio": 0.2, "num_random": 2}, r"^params\.num_random: "),
        ({"sparsity_ratio": 0.0}, r"^params\.sparsity_ratio: must be in \(0, 1\]"),
        ({"sparsity_ratio": 1.5}, r"^params\.sparsity_ratio: must be in"),
        ({"window": 1, "dilation": 2}, r"^params\.dilation: not used by pattern 'local_window'"),
        ({"window": 1, "seed": 3}, r"^params\.seed: not used by pattern"),
        ({"pattern": "random", "window": 1}, r"^params\.window: not used by pattern 'random'"),
        ({"pattern": "dilated", "window": 1, "dilation": 0}, r"^params\.dilation: "),
        ({"window": -1}, r"^params\.window: expected an integer >= 0"),
        ({"window": 1, "ordering": "zorder"}, r"^params\.ordering: "),
        ({"window": 1, "plan": "gpu"}, r"^params\.plan: must be one of auto, cpu, cuda"),
    ],
)
def test_invalid_parameters_raise_named_errors(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        attention.build("block_sparse", **params)


@pytest.mark.parametrize("pattern", bs_module.PATTERNS)
def test_the_defaults_are_valid_and_take_the_default_size(pattern) -> None:
    """No params (or a pattern alone): the size parameter is DEFAULT_SIZE (1) and the kernel
    matches the float64 reference of that mask, with a length no block divides."""
    module = attention.build(
        "block_sparse", **({} if pattern == "local_window" else {"pattern": pattern})
    )
    size = "num_random" if pattern == "random" else "window"
    assert getattr(module.params, size) == bs_module.DEFAULT_SIZE == 1
    assert module.params.sparsity_ratio is None and module.params.block_size == 64
    if pattern == "local_window":
        n = 3
        assert torch.equal(module.block_mask(150), _explicit_block_mask(pattern, n, window=1))
    assert_matches_reference(module, _reference(module, 64), 1, 150, 1, 4, causal=True)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("params", BOTH_PLANS_PARAMS, ids=lambda p: "-".join(map(str, p.values())))
def test_a_length_that_is_no_multiple_of_the_block_ends_in_a_short_block(
    params, causal, plan
) -> None:
    """30 tokens in blocks of 4 (or 2, then 31): the last block holds 2 (1) real tokens, which
    the mask treats as any block; nothing else is attended."""
    module = attention.build("block_sparse", plan=plan, **params)
    seq = 30 if params["block_size"] == 4 else 31
    assert module.block_mask(seq).shape[0] == -(-seq // params["block_size"])
    keep = block_token_mask(
        module.block_mask(seq), params["block_size"], causal=causal, seq_len=seq
    )
    assert module.flops(1, seq, 1, 1, causal=causal) == 4 * int(keep.sum())
    assert_matches_reference(module, _reference(module, params["block_size"]), 2, seq, 3, 8, causal)


def test_shape_constraints_raise_named_errors() -> None:
    attention.validate("block_sparse", {"block_size": 4, "window": 1}, seq_len=30)
    hilbert = {"block_size": 4, "window": 1, "ordering": "hilbert"}
    with pytest.raises(ValueError, match=r"^seq_len: 32 must be a power of 4"):
        attention.validate("block_sparse", hilbert, seq_len=32)
    unreachable = {"block_size": 1, "pattern": "dilated", "dilation": 4, "sparsity_ratio": 0.9}
    with pytest.raises(ValueError, match=r"^params\.sparsity_ratio: pattern 'dilated' cannot"):
        attention.validate("block_sparse", unreachable, seq_len=64)
    module = attention.build("block_sparse", block_size=4, window=1, ordering="hilbert")
    with pytest.raises(ValueError, match=r"^seq_len: 30 must be a power of 4"):
        module(*(torch.zeros(1, 30, 1, 4) for _ in range(3)))
    attention.validate("block_sparse", {"block_size": 4, "window": 1}, seq_len=32)


@st.composite
def block_sparse_configs(draw):
    pattern = draw(st.sampled_from(["local_window", "dilated", "global_local", "random"]))
    block_size = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 10))
    params = {"block_size": block_size, "pattern": pattern}
    if pattern == "random":
        params["seed"] = draw(st.integers(0, 100))
    if pattern == "dilated":
        params["dilation"] = draw(st.integers(1, 3))
    if pattern == "global_local":
        params["num_global"] = draw(st.integers(0, 2))
    if draw(st.booleans()) and pattern in ("local_window", "random"):  # always reachable
        params["sparsity_ratio"] = draw(st.sampled_from([0.1, 0.3, 0.5, 1.0]))
    elif pattern == "random":
        params["num_random"] = draw(st.integers(0, 4))
    else:
        params["window"] = draw(st.integers(0, 3))
    params["plan"] = draw(st.sampled_from(PLANS))
    return params, n * block_size - draw(st.integers(0, block_size - 1)), draw(st.booleans())


@settings(max_examples=25, deadline=None)
@given(config=block_sparse_configs(), batch=st.integers(1, 2), heads=st.integers(1, 3))
def test_property_random_valid_configs_match_reference(config, batch, heads) -> None:
    params, seq, causal = config
    module = attention.build("block_sparse", **params)
    mask = module.block_mask(seq)
    assert mask.diagonal().all()
    assert_matches_reference(
        module, _reference(module, params["block_size"]), batch, seq, heads, 4, causal
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("params", PARAMS[::2], ids=lambda p: p["pattern"])
def test_small_chunks_give_the_same_result(params, causal, monkeypatch) -> None:
    """Row chunking of the batched calls (forward and backward) changes nothing."""
    _patch(monkeypatch, "CHUNK_TOKENS", 8)
    module = attention.build("block_sparse", **params)
    assert_matches_reference(module, _reference(module, params["block_size"]), 2, 32, 2, 4, causal)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("units", [1, 3])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: "-".join(map(str, p.values())))
def test_windows_match_the_reference(params, units, causal, plan, accumulator_windows) -> None:
    """The forward in accumulator windows of 1 and 3 query blocks (how bf16 and fp16 run it,
    forced here for fp32): each call's rows cut at the windows' edges."""
    accumulator_windows(units)
    module = attention.build("block_sparse", plan=plan, **params)
    assert_matches_reference(module, _reference(module, params["block_size"]), 2, 33, 3, 8, causal)


def test_query_blocks_with_the_same_key_offsets_share_one_call() -> None:
    params = attention.make_params("block_sparse", {"block_size": 4, "window": 2})
    calls = bs_plan._plan(params, 64, False)
    rel = [c for c in calls if c.kind == "rel" and (c.a, c.b) == (-2, 3)]
    assert [(c.r0, c.r1) for c in rel] == [(2, 14)]
    assert len(calls) == 5  # interior rows in one call, 4 edge rows alone
    causal = bs_plan._plan(params, 64, True)
    assert [(c.r0, c.r1, c.masked) for c in causal if (c.a, c.b) == (-2, 1)] == [(2, 16, True)]


SUPERBLOCK_CASES = [  # bs 2: superblocks of 4 blocks, shared runs of 6 blocks or more
    # (params, which superblocks run (shifted or not): non-causal, causal)
    ({"block_size": 2, "pattern": "local_window", "window": 9}, {True, False}, {True, False}),
    ({"block_size": 2, "pattern": "global_local", "window": 6, "num_global": 2}, {False}, set()),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [80, 81])
@pytest.mark.parametrize("chunk", [2048, 20, 12])  # stairs: 4 rows a call, 2, then per run
@pytest.mark.parametrize(
    "case", SUPERBLOCK_CASES, ids=lambda c: f"{c[0]['pattern']}-{c[0]['window']}"
)
def test_superblocks_equal_the_reference(case, chunk, seq, causal, monkeypatch) -> None:
    """The forward's superblocks (one shared call, then the stairs merged in: one gathered call
    in a band's interior ("shifted", by rows as CHUNK_TOKENS allows), a call per row and
    stair where the band is clipped or no row fits a call), causal
    diagonals apart, leftover rows, and a short last block (seq 81): output and gradients equal
    the masked reference, and the expected kinds of superblock ran."""
    params, expected, expected_causal = case
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 8)
    _patch(monkeypatch, "CHUNK_TOKENS", chunk)
    tokens = bs_forward._forward_tokens(torch.device("cpu"))
    assert bs_forward._stair_rows(4, 2, tokens) == {2048: 4, 20: 2, 12: 0}[chunk]
    ran = []
    real = bs_forward._shared_forward

    def spy(*args):
        ran.append(args[1])  # (window, superblock, bs, scale)
        return real(*args)

    _patch(monkeypatch, "_shared_forward", spy)
    module = attention.build("block_sparse", **params)
    assert_matches_reference(module, _reference(module, params["block_size"]), 2, seq, 4, 4, causal)
    assert {sup.shifted for sup in ran} == (expected_causal if causal else expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [80, 81])
def test_superblocks_stay_inside_their_window(seq, causal, monkeypatch, accumulator_windows):
    """In windows of 7 blocks, superblocks of up to 4 blocks start again at each window (one
    never holds rows of two windows) and still equal the reference, gathered stairs included."""
    accumulator_windows(7)
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 8)
    ran = []
    real = bs_forward._shared_forward

    def spy(*args):
        sup, at = args[1], args[0].at  # (window, superblock, bs, scale)
        ran.append(sup)
        assert at % 7 == 0 and at <= sup.r0 < sup.r1 <= at + 7
        return real(*args)

    _patch(monkeypatch, "_shared_forward", spy)
    params = {"block_size": 2, "pattern": "local_window", "window": 9}
    module = attention.build("block_sparse", **params)
    assert_matches_reference(module, _reference(module, 2), 2, seq, 4, 4, causal)
    assert {sup.shifted for sup in ran} == {True, False}


def test_a_superblock_needs_a_shared_run_twice_as_wide_as_a_rows_stairs() -> None:
    """4 rows of a band of 7 blocks share 4 (stairs: 3 per row): no superblock; of 9: 6, one
    gathered ("shifted") call; rows of two runs, or runs that shrink, are no superblock."""
    band = [(i - 3, i + 4) for i in range(10, 14)]
    assert bs_plan._superblock([None] * 10 + band, 10, 14, 64) is None
    wide = [(i - 4, i + 5) for i in range(10, 14)]
    sup = bs_plan._superblock([None] * 10 + wide, 10, 14, 64)
    assert sup is not None and sup.shared == (9, 15) and sup.shifted
    assert sup.stairs[1] == (7, 9, 15, 16)  # row 11 keeps [7, 16)
    assert bs_plan._superblock([None] * 10 + wide[:3] + [None], 10, 14, 64) is None
    assert bs_plan._superblock([None] * 10 + wide[::-1], 10, 14, 64) is None
    clipped = [(0, i + 9) for i in range(0, 4)]
    sup = bs_plan._superblock(clipped, 0, 4, 64)
    assert sup is not None and sup.shared == (0, 9) and not sup.shifted


def test_superblocks_keep_exactly_the_kept_pairs(monkeypatch) -> None:
    """Shared keys plus stairs cover each kept token pair once: the pairs asked of the primitive
    equal the mask's count."""
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 8)
    seen = _spy_pairs(monkeypatch, "block_forward")
    for params, _, _ in SUPERBLOCK_CASES:
        module = attention.build("block_sparse", **params)
        q = torch.randn(1, 72, 2, 4)
        for causal in (False, True):
            seen.clear()
            with torch.no_grad():
                module(q, q, q, causal=causal)
            keep = block_token_mask(module.block_mask(72), 2, causal=causal)
            assert sum(p for _, p in seen) == 2 * int(keep.sum())
            supers, _ = bs_plan._forward_plan(module.params, 72, causal, 8)
            assert supers or causal, "no superblock ran"


@pytest.mark.parametrize("causal", [False, True])
def test_superblocks_with_grouped_query_heads_equal_sdpa(causal, monkeypatch) -> None:
    """k and v with 2 heads for q's 4 (the gathered stairs keep k's heads): the superblock
    forward and its gradients equal SDPA with enable_gqa on the pattern's token mask."""
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 8)
    module = attention.build("block_sparse", block_size=2, pattern="local_window", window=9)
    _assert_gqa_equals_sdpa(module, 2, causal, seed=3)


def _assert_gqa_equals_sdpa(module, block_size: int, causal: bool, seed: int) -> None:
    """The kernel on q with 4 heads and k, v with 2 (2 x 81 tokens, fp64): forward and gradients
    equal SDPA with enable_gqa on the pattern's token mask within 1e-10."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 81, 4, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 81, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = module(q, k, v, causal=causal)
    keep = block_token_mask(module.block_mask(81), block_size, causal=causal, seq_len=81)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=keep, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(ref, (q, k, v), dout),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [2, 4])  # superblocks of 4 blocks; blocks of 4 alone
def test_forward_calls_of_dense_sized_tiles_run_in_head_halves(block_size, causal, monkeypatch):
    """Calls of SUPERBLOCK_TOKENS queries or more (here 4: superblocks' shared runs at block 2,
    every block at block 4) hold the CPU op's dense-sized buffers, so they run one block row
    and half the heads at a time (kv heads to match, GQA 4:2): the forward and its gradients
    equal SDPA with enable_gqa on the pattern's token mask, and no such call had all heads."""
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 4 if block_size == 4 else 8)
    calls: list[tuple[int, int, int]] = []  # q's (block rows or batch, queries, heads)
    real = bs_forward.block_forward

    def spy(q, k, v, **kw):
        calls.append((q.shape[0], q.shape[1], q.shape[2]))
        return real(q, k, v, **kw)

    _patch(monkeypatch, "block_forward", spy)
    params = {"block_size": block_size, "pattern": "local_window", "window": 9}
    module = attention.build("block_sparse", **params)
    _assert_gqa_equals_sdpa(module, block_size, causal, seed=4)
    big = [c for c in calls if c[1] >= bs_forward.SUPERBLOCK_TOKENS]
    assert big and all(heads == 2 for _, _, heads in big), calls
    if block_size == 4:  # a block fills such a call: one row (of each batch row) at a time
        assert all(rows * queries <= 2 * block_size for rows, queries, _ in big), calls


def test_a_forward_calls_rows_follow_its_device() -> None:
    """On CPU a block of SUPERBLOCK_TOKENS or more runs alone (the op's tiles are full), smaller
    ones as many as FORWARD_TOKENS_PER_THREAD per thread allow; CUDA's calls take CHUNK_TOKENS
    of rows at every block size (one row of 1024 would halve a call's thread blocks)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    on_cpu, on_cuda = bs_forward._forward_tokens(cpu), bs_forward._forward_tokens(cuda)
    assert bs_forward._rows_per_call(cpu, 64, on_cpu) == on_cpu // 64
    assert bs_forward._rows_per_call(cpu, bs_forward.SUPERBLOCK_TOKENS, on_cpu) == 1
    assert bs_forward._rows_per_call(cpu, 4096, on_cpu) == 1
    assert on_cuda == bs_forward.CHUNK_TOKENS == 2048
    rows = [bs_forward._rows_per_call(cuda, bs, on_cuda) for bs in (64, 768, 1024, 4096)]
    assert rows == [32, 2, 2, 1]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_cpu_forward_calls_queries_scale_with_the_threads(threads, monkeypatch) -> None:
    """On CPU a forward call holds FORWARD_TOKENS_PER_THREAD queries per torch thread (here 8):
    one thread runs a local window's rows (plan calls, no superblocks) 4 blocks of 2 a call, two
    threads 8 (and a superblock of 4 rows gathers no stairs row a call, or one); the forward and
    its gradients equal SDPA on the token mask either way."""
    _patch(monkeypatch, "FORWARD_TOKENS_PER_THREAD", 8)
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 10**6)  # plan calls only
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bound = bs_forward._forward_tokens(torch.device("cpu"))
        assert bound == 8 * threads
        assert bs_forward._stair_rows(4, 2, bound) == threads - 1
        rows_a_call: list[int] = []
        real = bs_plan._chunks

        def spy(call, rows_per_call):
            if sys._getframe(1).f_code.co_name == "_call_forward":  # the backward cuts its own
                rows_a_call.append(rows_per_call)
            return real(call, rows_per_call)

        _patch(monkeypatch, "_chunks", spy)
        params = {"block_size": 2, "pattern": "local_window", "window": 9}
        _assert_gqa_equals_sdpa(attention.build("block_sparse", **params), 2, False, seed=6)
    finally:
        torch.set_num_threads(before)
    assert set(rows_a_call) == {bound // 2}, rows_a_call


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [48, 50])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: "-".join(map(str, p.values())))
def test_the_backwards_small_calls_equal_the_reference(params, seq, causal, monkeypatch) -> None:
    """The backward cut small: superblocks as plain calls, queries cut inside a block (rel calls
    as a row's abs call each once a block fills a call; a causal diagonal's mask cut with its
    queries), key parts, heads one at a time, kv heads grouped, a short last block (seq 50):
    gradients equal the masked reference's."""
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 8)
    _patch(monkeypatch, "BACKWARD_QUERY_TOKENS", 3)
    _patch(monkeypatch, "BACKWARD_KEY_TOKENS", 4)
    _patch(monkeypatch, "CALL_ROW_HEADS", 20)
    module = attention.build("block_sparse", **params)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, seq, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, seq, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = k.requires_grad_(), v.requires_grad_()
    keep = block_token_mask(
        module.block_mask(seq), params["block_size"], causal=causal, seq_len=seq
    )
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=keep, enable_gqa=True
    ).transpose(1, 2)
    out = module(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"d{name}")
    plan = bs_plan._backward_plan(module.params, seq, causal, 8, 3, 4)
    bs = params["block_size"]
    assert all(c.key_blocks * bs <= max(bs, 4) for c in plan), "key parts"
    if bs >= 3:  # a block fills a call: rel rows are abs calls, their queries cut
        assert all(c.kind != "rel" for c in plan)


@pytest.mark.parametrize("heads", [1, 4, 8, 32])
@pytest.mark.parametrize("call", [
    bs_plan._Call("rel", 0, 40, -2, 3),
    bs_plan._Call("rel", 0, 40, -32, 1, masked=True),
    bs_plan._Call("abs", 0, 12, 0, 8),
    bs_plan._Call("abs", 0, 1, 0, 32),
    bs_plan._Call("gather", 5, 6, blocks=(0, 2, 5)),
    bs_plan._Call("abs", 0, 4, 0, 64),  # 4096 keys: alone over the budget
], ids=lambda c: f"{c.kind}-{c.key_blocks}")  # fmt: skip
def test_a_backward_calls_temporaries_stay_within_the_budget(call, heads) -> None:
    """dq and dout's copy per query token, dk and dv per key token (each rel row its own):
    within CALL_ROW_HEADS rows x heads unless one head and one unit of queries exceed it;
    heads in powers of two, queries whole blocks for rel calls and within the bound."""
    bs = 64
    tokens, max_heads = bs_backward._backward_split(call, bs, heads)
    keys = call.key_blocks * bs
    temps = max_heads * (
        tokens * (2 + 2 * call.key_blocks) if call.kind == "rel" else 2 * tokens + 2 * keys
    )
    # over it only where one head, one unit of queries and the keys (a rel row's, or one
    # call's) cannot fit; queries then go as far as the bound (fewer would only be slower)
    unit = bs if call.kind == "rel" else 1
    alone = max_heads * ((2 + 2 * call.key_blocks) * bs if call.kind == "rel" else 2 + 2 * keys)
    assert temps <= bs_backward.CALL_ROW_HEADS or (
        max_heads == 1 and alone > bs_backward.CALL_ROW_HEADS
    )
    if alone > bs_backward.CALL_ROW_HEADS:
        assert tokens == max(unit, bs_backward.BACKWARD_QUERY_TOKENS) // unit * unit
    assert max_heads & (max_heads - 1) == 0 and 1 <= max_heads <= heads
    assert tokens <= max(bs_backward.BACKWARD_QUERY_TOKENS, bs if call.kind == "rel" else 0)
    assert call.kind != "rel" or tokens % bs == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("params", PARAMS[:4], ids=lambda p: "-".join(map(str, p.values())))
def test_the_backward_computes_each_kept_pair_once_within_the_query_bound(
    params, causal, monkeypatch
) -> None:
    """The pairs the backward asks of the primitive equal the mask's count, and no call has
    more queries than BACKWARD_QUERY_TOKENS (a rel call's: whole blocks, at least one)."""
    _patch(monkeypatch, "SUPERBLOCK_TOKENS", 8)
    _patch(monkeypatch, "BACKWARD_QUERY_TOKENS", 3)
    _patch(monkeypatch, "BACKWARD_KEY_TOKENS", 4)
    _patch(monkeypatch, "CALL_ROW_HEADS", 20)
    bs = params["block_size"]
    seen = _spy_pairs(monkeypatch, "block_backward")
    module = attention.build("block_sparse", **params)
    q = torch.randn(1, 50, 2, 4, requires_grad=True)
    module(q, q, q, causal=causal).sum().backward()
    keep = block_token_mask(module.block_mask(50), bs, causal=causal, seq_len=50)
    assert sum(p for _, p in seen) == 2 * int(keep.sum())
    assert max(n for n, _ in seen) <= 3  # blocks of 4 cut inside, rel rows of 2 whole
