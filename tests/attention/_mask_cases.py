"""The masks and balances the mask tests run, and the dense fp64 reference from an explicit
mask (the mask's predicate over the whole sequence), forward and gradients."""

from __future__ import annotations

from typing import Any

import torch

from attention.mask import parse

S = 512
"""Tokens: divides by ptrr's block (128) x 4 ranks, and every document below by 2 x 4."""
SHAPE = (1, S, 4, 8)  # batch, seq, query heads, head_dim
KV_HEADS = 2  # grouped-query attention: two query heads per key/value head
LENGTHS = [200, 136, 96, 80]

MASKS: list[dict[str, Any]] = [
    {"kind": "full"},
    {"kind": "causal"},
    {"kind": "sliding_window", "causal": True, "window": 40},
    {"kind": "sliding_window", "causal": False, "window": 40},
    {"kind": "prefix_lm", "prefix": 100},
    {"kind": "documents", "causal": True, "lengths": LENGTHS},
    {"kind": "documents", "causal": False, "lengths": LENGTHS},
    {"kind": "documents", "causal": True, "lengths": LENGTHS, "window": 24},
]


def mask_id(mask: dict[str, Any]) -> str:
    """A short readable name of a mask case."""
    extra = "-".join(f"{k}{v}" for k, v in mask.items() if k in ("causal", "window", "prefix"))
    kind = mask.get("kind", "legacy")
    return f"{kind}-{extra}" if extra else kind


def inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """fp64 q, k, v (k, v with KV_HEADS heads) and an upstream gradient on the full sequence."""
    g = torch.Generator().manual_seed(seed)
    kv = (*SHAPE[:2], KV_HEADS, SHAPE[3])
    shapes = (SHAPE, kv, kv, SHAPE)
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)


def reference(mask: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v in fp64 under mask.dense(S), with its q, k, v gradients."""
    q, k, v, dout = inputs(seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = SHAPE[2] // KV_HEADS
    kr, vr = (t.repeat_interleave(group, dim=2) for t in (k, v))
    keep = parse(mask).dense(S)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * SHAPE[3] ** -0.5
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def assert_shards_match(
    per_rank: list[list[dict[str, Any]]], i: int, ref: dict[str, torch.Tensor], case: tuple
) -> None:
    """Case `i`'s shards put back together equal the fp64 reference `ref`, forward and
    gradients (within 1e-10), every token on exactly one rank."""
    held = torch.cat([r[i]["held"] for r in per_rank])
    assert sorted(held.tolist()) == list(range(S))  # every token on exactly one rank
    for name in ("out", "dq", "dk", "dv"):
        got = torch.cat([r[i][name] for r in per_rank], dim=1)
        torch.testing.assert_close(
            got,
            ref[name][:, held],
            atol=1e-10,
            rtol=1e-9,
            msg=lambda m, n=name: f"{n} {case}: {m}",
        )
