"""`ring_dilated` in real gloo processes equals `dilated` on the full tensors (out and grads),
for W in {1, 2, 4}, local and rank-spanning segments, every layout, causal or not, natural or
Hilbert order."""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import RankFailed, run_ranks
from _ring_helpers import assert_equals_twin, layout_cases, seeded_inputs, trained

import attention
from attention.hilbert import hilbert_permutation

pytestmark = pytest.mark.timeout(120)

SHAPE = (2, 64, 3, 8)
CONFIGS = [
    # (segment_lengths, dilation_rates, ordering): at W=4 (16 tokens a rank) 8 is local,
    # 32 spans 2 ranks, 64 spans 4; r=8 > 3 heads leaves offsets uncovered in that branch.
    ((8, 32, 64), (1, 2, 4), "natural"),
    ((16,), (2,), "natural"),
    ((4, 64), (2, 8), "natural"),
    ((8, 32, 64), (1, 2, 4), "hilbert"),
    # Lengths that do not divide (attention.dilated's conventions): segments of 6 and 24
    # straddle shard boundaries, 6 % 4 and 24 % 5 != 0, rows per rank differ, 100 > seq.
    ((6, 24, 100), (4, 5, 2), "natural"),
    # The paper's rates 1, 2, 4, 6, 12 (w = 64, 128 span 2 and 4 ranks at W = 4).
    ((8, 16, 32, 64, 128), (1, 2, 4, 6, 12), "natural"),
]
CASES = layout_cases(CONFIGS)


def rank_cases(rank: int, world: int) -> list[dict]:
    return _rank_results(rank, world, CASES, seed=0)


def _rank_results(rank: int, world: int, cases: list[tuple], seed: int, **extra: str) -> list[dict]:
    """Each case's training call on this rank's shard (inputs drawn from seed + its index)."""
    results = []
    for i, ((ws, rs, ordering), layout, causal) in enumerate(cases):
        module = attention.build(
            "ring_dilated", segment_lengths=ws, dilation_rates=rs, ordering=ordering,
            layout=layout, **extra,
        )  # fmt: skip
        pos = module.local_positions(SHAPE[1], rank, world)
        inputs = tuple(t[:, pos].clone() for t in seeded_inputs(seed + i, SHAPE))
        results.append(trained(module, inputs, causal))
        if extra.get("plan") == "cuda":
            assert module.backend.endswith("/plan-cuda") and module.plan == "cuda"
    return results


def twin_reference(seed: int, ws, rs, ordering: str, causal: bool) -> dict:
    twin = attention.build("dilated", segment_lengths=ws, dilation_rates=rs, ordering=ordering)
    return trained(twin, seeded_inputs(seed, SHAPE), causal)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_dilated_equals_dilated(world):
    per_rank = run_ranks(rank_cases, world)
    for i, ((ws, rs, ordering), layout, causal) in enumerate(CASES):
        ref = twin_reference(i, ws, rs, ordering, causal)
        perm = hilbert_permutation(SHAPE[1]) if ordering == "hilbert" else None
        case = (ws, rs, ordering, layout, causal)
        assert_equals_twin([r[i] for r in per_rank], layout, ref, case, perm)


PAPER_SHAPE = (1, 2200, 12, 4)
PAPER = ((64, 128, 256, 512, 1024), (1, 2, 4, 6, 12))
"""LongNet's configuration scaled to CPU by 1/32 on a length that is no multiple of 1024."""


def rank_paper(rank: int, world: int) -> list[dict]:
    results = []
    for causal in (False, True):
        module = attention.build("ring_dilated", segment_lengths=PAPER[0], dilation_rates=PAPER[1])
        g = torch.Generator().manual_seed(int(causal))
        full = [torch.randn(*PAPER_SHAPE, generator=g) for _ in range(4)]
        pos = module.local_positions(PAPER_SHAPE[1], rank, world)
        q, k, v, dout = (t[:, pos].clone() for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        module(q, k, v, causal=causal).backward(dout)
        out = module(q, k, v, causal=causal).detach()
        results.append({"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad})
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_the_papers_configuration_equals_dilated(world):
    """Shards of 1100 and 550 tokens: segments of 1024 and 512 straddle shard boundaries."""
    per_rank = run_ranks(rank_paper, world)
    twin = attention.build("dilated", segment_lengths=PAPER[0], dilation_rates=PAPER[1])
    for i, causal in enumerate((False, True)):
        g = torch.Generator().manual_seed(int(causal))
        q, k, v, dout = (torch.randn(*PAPER_SHAPE, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = twin(q, k, v, causal=causal)
        out.backward(dout)
        ref = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        for name in ref:
            got = torch.cat([r[i][name] for r in per_rank], dim=1)
            torch.testing.assert_close(got, ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_validate_accepts_any_segments_and_names_the_layout_rules():
    params = {"segment_lengths": [8, 32], "dilation_rates": [1, 4]}
    attention.validate("ring_dilated", params, seq_len=64, world_size=4)
    attention.validate("ring_dilated", params, seq_len=64, world_size=16)  # 8 spans 2 ranks
    paper = {"segment_lengths": [2048, 4096, 8192, 16384, 32768], "dilation_rates": PAPER[1]}
    attention.validate("ring_dilated", paper, seq_len=3 * 4096, world_size=2)
    with pytest.raises(ValueError, match=r"seq_len: 98 must be divisible by world_size 4"):
        attention.validate("ring_dilated", params, seq_len=98, world_size=4)
    zigzag = {**params, "layout": "zigzag"}
    attention.validate("ring_dilated", zigzag, seq_len=64, world_size=4)
    with pytest.raises(ValueError, match=r"seq_len: 96 must be divisible by 2 x world_size = 64"):
        attention.validate("ring_dilated", {**zigzag}, seq_len=96, world_size=32)
    with pytest.raises(ValueError, match=r"params.layout: must be one of"):
        attention.build("ring_dilated", layout="diagonal")
    assert attention.KERNELS["ring_dilated"].distributed


def rank_bad_shard(rank: int, world: int) -> None:
    q = torch.randn(1, 4, 2, 8)  # 8 tokens in all: no square grid for hilbert ordering
    module = attention.build(
        "ring_dilated", segment_lengths=[16], dilation_rates=[1], ordering="hilbert"
    )
    module(q, q, q)


def test_bad_shard_fails_fast_with_the_rule():
    with pytest.raises(RankFailed, match=r"seq_len: 8 must be a power of 4"):
        run_ranks(rank_bad_shard, 2)


def test_the_plan_reaches_the_twin():
    """ring_dilated takes every plan (the plan that ran ends its backend string: checked in
    the ranks below); its twin takes the plan as given."""
    for plan in ("auto", "cpu", "cuda"):
        assert attention.make_params("ring_dilated", {"plan": plan}).twin().plan == plan


# non-dividing segments; the paper's rates
CUDA_CASES = layout_cases([CONFIGS[4], CONFIGS[5]], ("contiguous", "zigzag"))


def rank_cuda_plan(rank: int, world: int) -> list[dict]:
    """CUDA_CASES with the cuda plan forced (the CPU flash op in its call structure)."""
    return _rank_results(rank, world, CUDA_CASES, seed=100, plan="cuda")


@pytest.mark.parametrize("world", [2, 4])
def test_the_cuda_plan_equals_dilated(world):
    """Local spans by dilated's cuda plan, shared segments as before: out and gradients equal
    `dilated` on the full tensors, at W = 2 and 4, segments local, spanning ranks and not
    dividing, the paper's rates (scaled), contiguous and zigzag, causal or not."""
    per_rank = run_ranks(rank_cuda_plan, world)
    for i, ((ws, rs, ordering), layout, causal) in enumerate(CUDA_CASES):
        ref = twin_reference(100 + i, ws, rs, ordering, causal)
        assert_equals_twin([r[i] for r in per_rank], layout, ref, (ws, rs, layout, causal))
