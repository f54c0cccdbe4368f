"""`ring_dilated` in real gloo processes equals `dilated` on the full tensors (out and grads),
for W in {1, 2, 4}, local and rank-spanning segments, every layout, causal or not, natural or
Hilbert order."""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import RankFailed, run_ranks

import attention
from attention import layouts
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
]
CASES = [
    (cfg, layout, causal)
    for cfg in CONFIGS
    for layout in ("contiguous", "zigzag", "striped")
    for causal in (False, True)
]


def full_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*SHAPE, generator=g) for _ in range(4))


def rank_cases(rank: int, world: int) -> list[dict]:
    results = []
    for i, ((ws, rs, ordering), layout, causal) in enumerate(CASES):
        module = attention.build(
            "ring_dilated", segment_lengths=ws, dilation_rates=rs, ordering=ordering, layout=layout
        )
        pos = module.local_positions(SHAPE[1], rank, world)
        q, k, v, dout = (t[:, pos].clone() for t in full_inputs(i))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = module(q, k, v, causal=causal)
        out.backward(dout)
        flops = module.flops(SHAPE[0], SHAPE[1] // world, SHAPE[2], SHAPE[3], causal)
        results.append(
            {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "flops": flops}
        )
    return results


def twin_reference(i: int, ws, rs, ordering: str, causal: bool) -> dict:
    q, k, v, dout = full_inputs(i)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    twin = attention.build("dilated", segment_lengths=ws, dilation_rates=rs, ordering=ordering)
    out = twin(q, k, v, causal=causal)
    out.backward(dout)
    flops = twin.flops(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[3], causal)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "flops": flops}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_dilated_equals_dilated(world):
    per_rank = run_ranks(rank_cases, world)
    for i, ((ws, rs, ordering), layout, causal) in enumerate(CASES):
        ref = twin_reference(i, ws, rs, ordering, causal)
        perm = hilbert_permutation(SHAPE[1]) if ordering == "hilbert" else torch.arange(SHAPE[1])
        for name in ("out", "dq", "dk", "dv"):
            got = layouts.unshard([r[i][name] for r in per_rank], layout)
            torch.testing.assert_close(
                got, ref[name][:, perm], atol=1e-5, rtol=1e-5,
                msg=lambda m, n=name, c=(ws, rs, ordering, layout, causal): f"{n} {c}: {m}",
            )  # fmt: skip
        assert sum(r[i]["flops"] for r in per_rank) == ref["flops"], (ws, rs, causal)


def test_validate_names_the_shard_rules():
    params = {"segment_lengths": [8, 32], "dilation_rates": [1, 4]}
    attention.validate("ring_dilated", params, seq_len=64, world_size=4)
    attention.validate("ring_dilated", params, seq_len=64, world_size=16)  # 8 spans 2 ranks
    one = {"segment_lengths": [32], "dilation_rates": [1]}
    with pytest.raises(ValueError, match=r"seq_len: the shard of 48 tokens .* segment length 32"):
        attention.validate("ring_dilated", one, seq_len=96, world_size=2)
    bad_rate = {"segment_lengths": [32], "dilation_rates": [16]}
    with pytest.raises(ValueError, match=r"segment length 32 spans .* 8 must divide by .* 16"):
        attention.validate("ring_dilated", bad_rate, seq_len=64, world_size=8)
    with pytest.raises(ValueError, match=r"seq_len: 48 must divide by every segment length"):
        attention.validate("ring_dilated", params, seq_len=48, world_size=2)
    zigzag = {**params, "layout": "zigzag"}
    attention.validate("ring_dilated", zigzag, seq_len=64, world_size=4)
    with pytest.raises(ValueError, match=r"seq_len: 96 must divide by 2 x world_size = 64"):
        attention.validate("ring_dilated", {**one, "layout": "zigzag"}, seq_len=96, world_size=32)
    with pytest.raises(ValueError, match=r"params.layout: must be one of"):
        attention.build("ring_dilated", layout="diagonal")
    assert attention.KERNELS["ring_dilated"].distributed


def rank_bad_shard(rank: int, world: int) -> None:
    q = torch.randn(1, 4, 2, 8)  # 8 tokens in all: the segment of 16 does not divide it
    attention.build("ring_dilated", segment_lengths=[16], dilation_rates=[1])(q, q, q)


def test_bad_shard_fails_fast_with_the_rule():
    with pytest.raises(RankFailed, match=r"seq_len: 8 must divide by every segment length"):
        run_ranks(rank_bad_shard, 2)
