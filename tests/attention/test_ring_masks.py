"""`ring`, `allgather_kv` and `usp` (U = 2) under every mask kind and balance, and `ulysses`
under every mask kind, in real gloo processes at W in {1, 2, 4}, with grouped-query attention:
each rank holds the tokens its order puts at its positions (`local_positions`), and its outputs
and q/k/v gradients equal the fp64 reference computed from the mask's explicit predicate over
the whole sequence. One process group per W runs every case; K/V pieces of 64 rows cut the mask
plan's blocks as a long shard does, masked chunks of 32 rows hold fused middles."""

from __future__ import annotations

from typing import Any

import pytest
from _dist_helpers import run_ranks
from _mask_cases import LENGTHS, MASKS, S, assert_shards_match, inputs, mask_id, reference

import attention
from attention.mask import from_legacy, parse
from attention.ring import engine, mask_plan

pytestmark = pytest.mark.timeout(300)

BALANCES = [None, "none", "head_tail", "per_document", "ptrr"]
CASES = [
    (kernel, mask, balance)
    for kernel in ("ring", "allgather_kv")
    for mask in MASKS
    for balance in BALANCES
    if balance != "per_document" or mask["kind"] == "documents"
] + [("ulysses", mask, None) for mask in MASKS]  # ulysses takes no balance: it needs none
CASES += [("ring", {"legacy": True}, "per_document")]  # causal + document_lengths, balanced
CASES += [
    ("usp", mask, balance)
    for mask in MASKS
    for balance in (None, "head_tail", "per_document", "ptrr")
    if balance != "per_document" or mask["kind"] == "documents"
]


def ring_case(
    kernel: str, rank: int, world: int, mask: dict[str, Any], balance: str | None, seed: int
) -> dict:
    """This rank's out and q/k/v gradients through `kernel`, and the global tokens it held."""
    extra: dict[str, Any] = {"ulysses_degree": min(2, world)} if kernel == "usp" else {}
    if "legacy" in mask:  # the older spelling: causal + document_lengths
        causal, extra["document_lengths"] = True, LENGTHS
        module = attention.build(kernel, balance=balance, **extra)
    else:
        causal = parse(mask).causal
        module = attention.build(kernel, mask=mask, balance=balance, **extra)
    held = module.local_positions(S, rank, world, causal=causal)
    q, k, v, dout = (t[:, held].clone() for t in inputs(seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = module(q, k, v, causal=causal)
    out.backward(dout)
    return {"held": held, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def rank_all_cases(rank: int, world: int) -> list[dict]:
    engine.PIECE_TOKENS = 64
    mask_plan.MASK_ROWS = 32  # masked chunks with a fused middle at these short windows
    return [ring_case(k, rank, world, m, b, seed=i) for i, (k, m, b) in enumerate(CASES)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_kernels_are_exact_under_every_mask_and_balance(world: int) -> None:
    per_rank = run_ranks(rank_all_cases, world, deadline_s=280.0)
    for i, (kernel, mask, balance) in enumerate(CASES):
        ref = reference(from_legacy(True, LENGTHS) if "legacy" in mask else mask, seed=i)
        assert_shards_match(per_rank, i, ref, (kernel, mask_id(mask), balance))
