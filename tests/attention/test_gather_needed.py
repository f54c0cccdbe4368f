"""`allgather_kv` with `gather: needed` (only the K/V rows a rank's queries keep a pair with)
under every mask kind and balance it declares, in real gloo processes at W in {1, 2, 4}, with
grouped-query attention: outputs and q/k/v gradients equal the fp64 reference from the mask's
explicit predicate, and the bytes each rank receives are the bytes its mask needs (counted by
the step clock, recomputed here from the dense mask)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_helpers import run_ranks
from _mask_cases import KV_HEADS, MASKS, SHAPE, S, assert_shards_match, inputs, mask_id, reference

import attention
from attention.errors import ParamError
from attention.mask import parse
from attention.ring import engine, mask_plan
from attention.ring.sharded import ALL_BALANCES
from attention.ring.steps import clock

pytestmark = pytest.mark.timeout(300)

CASES = [
    (mask, balance)
    for mask in MASKS
    for balance in [None, *sorted(ALL_BALANCES)]
    if balance != "per_document" or mask["kind"] == "documents"
]
ROW_BYTES = 2 * KV_HEADS * SHAPE[3] * 8  # one token's K and V rows, fp64


def needed_case(rank: int, world: int, mask: dict[str, Any], balance: str | None, seed: int):  # type: ignore[no-untyped-def]
    """This rank's out, q/k/v gradients, held tokens and forward received bytes."""
    causal = parse(mask).causal
    module = attention.build("allgather_kv", mask=mask, balance=balance, gather="needed")
    held = module.local_positions(S, rank, world, causal=causal)
    q, k, v, dout = (t[:, held].clone() for t in inputs(seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    clock.start(q.device)
    out = module(q, k, v, causal=causal)
    forward = sum(s["received_bytes"] for s in clock.collect() if s["phase"] == "forward")
    clock.stop()
    out.backward(dout)
    return {"held": held, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "received": forward}  # fmt: skip


def rank_all_cases(rank: int, world: int) -> list[dict]:
    engine.PIECE_TOKENS = 64
    mask_plan.MASK_ROWS = 32
    return [needed_case(rank, world, m, b, seed=i) for i, (m, b) in enumerate(CASES)]


def needed_bytes(mask: dict[str, Any], held: list[torch.Tensor], rank: int) -> int:
    """Bytes of the other ranks' K/V rows that rank's queries keep a pair with (dense mask)."""
    keep = parse(mask).dense(S)
    kept = keep[held[rank]].any(0)  # by global key token
    others = [h for r, h in enumerate(held) if r != rank]
    return sum(int(kept[h].sum()) for h in others) * ROW_BYTES


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gather_needed_is_exact_under_every_mask_and_balance(world: int) -> None:
    per_rank = run_ranks(rank_all_cases, world, deadline_s=280.0)
    for i, (mask, balance) in enumerate(CASES):
        ref = reference(mask, seed=i)
        held_each = [r[i]["held"] for r in per_rank]
        assert_shards_match(per_rank, i, ref, (mask_id(mask), balance))
        for rank in range(world):
            assert per_rank[rank][i]["received"] == needed_bytes(mask, held_each, rank), (
                mask_id(mask), balance, rank)  # fmt: skip


def test_an_unknown_gather_is_refused_naming_it() -> None:
    with pytest.raises(ParamError) as raised:
        attention.build("allgather_kv", gather="some")
    assert raised.value.path[:2] == ("params", "gather")
    assert "all, needed" in str(raised.value)
