"""Each sharded kernel's count of the K/V bytes a rank receives in a forward pass and wastes
(kv_comm_bytes), recomputed from the dense mask over the tokens every rank holds
(local_positions): ring (every layout), allgather_kv under gather all and needed, and usp's
ring (its groups' tokens, H_kv / U heads a rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _mask_cases import LENGTHS, MASKS, S, mask_id

import attention
from attention.mask import parse
from attention.ring.sharded import HeadShape

WORLD = 4
HEAD_BYTES = 16 * 4  # head_dim 16, float32


def _recount(keep: torch.Tensor, mine: torch.Tensor, others: list[torch.Tensor]) -> tuple[int, int]:
    """(rows of `others`, of them the rows the queries `mine` keep a pair with)."""
    kept = keep[mine].any(0)
    return sum(o.numel() for o in others), sum(int(kept[o].sum()) for o in others)


CASES = [
    ("ring", {"layout": "striped"}, False),
    ("ring", {"layout": "zigzag"}, True),
    ("ring", {"balance": "ptrr"}, False),
    ("allgather_kv", {}, False),
    ("allgather_kv", {"gather": "needed"}, False),
    ("allgather_kv", {"balance": "head_tail", "gather": "needed"}, False),
]


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize(("kernel", "params", "legacy"), CASES)
def test_ring_and_allgather_count_the_rows_their_mask_keeps(
    kernel: str, params: dict[str, Any], legacy: bool, mask: dict[str, Any]
) -> None:
    causal = parse(mask).causal
    if legacy and mask["kind"] not in ("full", "causal"):
        pytest.skip("the older spelling is full or causal")
    if params.get("layout") == "striped" and mask["kind"] not in ("full", "causal"):
        pytest.skip("striped shards run the layouts' own plans: full and causal only")
    module = attention.build(kernel, **params, **({} if legacy else {"mask": mask}))
    n = S // WORLD
    held = [module.local_positions(S, r, WORLD, causal=causal) for r in range(WORLD)]
    keep = parse(mask).dense(S)
    needed = params.get("gather") == "needed"
    for rank in range(WORLD):
        rows, kept = _recount(keep, held[rank], [h for r, h in enumerate(held) if r != rank])
        assert rows == (WORLD - 1) * n
        want = (kept, 0) if needed else (rows, rows - kept)
        row = 2 * 2 * HEAD_BYTES  # two kv heads
        got = module.kv_comm_bytes(n, HeadShape(4, 2, HEAD_BYTES), causal, rank, WORLD)
        assert got == (want[0] * row, want[1] * row), (rank, mask_id(mask))


@pytest.mark.parametrize("balance", [None, "ptrr"])
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_usp_counts_its_rings_rows_of_its_heads(balance: str | None, kv_heads: int) -> None:
    mask = {"kind": "documents", "causal": True, "lengths": LENGTHS}
    u = 2
    module = attention.build("usp", mask=mask, balance=balance, ulysses_degree=u)
    n = S // WORLD
    held = [module.local_positions(S, r, WORLD, causal=True) for r in range(WORLD)]
    groups = [torch.cat(held[g * u : (g + 1) * u]) for g in range(WORLD // u)]
    keep = parse(mask).dense(S)
    row = 2 * max(kv_heads, u) // u * HEAD_BYTES
    for rank in range(WORLD):
        g = rank // u
        rows, kept = _recount(keep, groups[g], [h for j, h in enumerate(groups) if j != g])
        got = module.kv_comm_bytes(n, HeadShape(4, kv_heads, HEAD_BYTES), True, rank, WORLD)
        assert got == (rows * row, (rows - kept) * row)
        assert rows == (WORLD // u - 1) * u * n


def test_kernels_that_do_not_count_say_none() -> None:
    heads = HeadShape(4, 2, HEAD_BYTES)
    assert attention.build("ulysses").kv_comm_bytes(128, heads, True, 0, 2) is None
