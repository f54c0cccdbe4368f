"""What a rank stores of the K/V it received (comm_bytes, wasted_comm_bytes) and of the ring
steps that computed nothing (StepTime.skipped), recomputed here from the dense mask and the
tokens each rank held, and checked against the bytes the step clock saw arrive."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_helpers import run_ranks
from _workers_helpers import config

import attention
from attention.block_sparse import BlockSparseAttention
from attention.mask import expand, parse
from workers import protocol

S = 512
WORLD = 2
DOCS = expand(
    {
        "kind": "documents",
        "causal": True,
        "sampled": {"distribution": "lognormal", "mean": 96, "max_fraction": 0.25, "seed": 0,
                    "multiple_of": 4},
    },
    S,
)  # fmt: skip
SETUP: dict[str, Any] = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 16}
ROW = 2 * 1 * 16 * 4  # one token's K and V rows: one kv head of 16 float32 values each


def rank_run(rank: int, world: int, kernel: str, params: dict[str, Any]) -> dict[str, Any]:
    """This rank's stored comm fields, its forward steps and the tokens it held (train mode)."""
    cfg = config(kernel=kernel, params=params, seq_len=S, world_size=world, causal=True,
                 mode="train", correctness_check=False, **SETUP)  # fmt: skip
    case = protocol.run_case(cfg, rank)
    assert case.status == "ok", case.error
    result = case.result
    held = attention.build(kernel, **params).local_positions(S, rank, world, causal=True)
    forward = [s for s in result.steps if s.phase == "forward"]
    return {
        "comm": result.comm_bytes,
        "wasted": result.wasted_comm_bytes,
        "received": [sum(s.received_bytes for s in forward if s.iteration == i)
                     for i in range(cfg.iterations)],
        "skipped": {s.step: s.skipped for s in forward if s.iteration == 0},
        "held": held,
    }  # fmt: skip


def recount(held: list[torch.Tensor], rank: int) -> tuple[int, int]:
    """(rows of the other shards, of them the rows this rank's queries keep) from DOCS."""
    keep = parse(DOCS, S).dense(S)
    kept = keep[held[rank]].any(0)
    others = [h for r, h in enumerate(held) if r != rank]
    return sum(h.numel() for h in others), sum(int(kept[h].sum()) for h in others)


@pytest.mark.parametrize(
    ("kernel", "params"),
    [
        ("ring", {"mask": DOCS, "balance": "none"}),
        ("allgather_kv", {"mask": DOCS, "balance": "ptrr"}),
        ("allgather_kv", {"mask": DOCS, "balance": "ptrr", "gather": "needed"}),
    ],
)
def test_each_rank_stores_the_kv_bytes_it_received_and_wasted(
    kernel: str, params: dict[str, Any]
) -> None:
    """All: every other shard is received, the rows no query of the rank keeps are wasted;
    needed: only the kept rows, nothing wasted. Train mode receives them forward and backward;
    the forward's half is what the step clock counted arriving in every iteration."""
    ranks = run_ranks(rank_run, WORLD, kernel, params)
    held = [r["held"] for r in ranks]
    for rank, got in enumerate(ranks):
        rows, kept = recount(held, rank)
        if params.get("gather") == "needed":
            want = (2 * kept * ROW, 0)
        else:
            want = (2 * rows * ROW, 2 * (rows - kept) * ROW)
        assert (got["comm"], got["wasted"]) == want
        assert got["received"] == [want[0] // 2] * len(got["received"])
    assert sum(r["wasted"] for r in ranks) > 0 or params.get("gather") == "needed"


def test_a_ring_step_whose_keys_keep_no_pair_says_it_was_skipped() -> None:
    """Causal documents on contiguous shards: rank 0's queries keep nothing of rank 1's later
    tokens, so its step 1 computes nothing and its row says so; every other step computed."""
    ranks = run_ranks(rank_run, WORLD, "ring", {"mask": DOCS, "balance": "none"})
    held = [r["held"] for r in ranks]
    keep = parse(DOCS, S).dense(S)
    for rank, got in enumerate(ranks):
        want = {
            t: not bool(keep[held[rank]][:, held[(rank - t) % WORLD]].any()) for t in range(WORLD)
        }
        assert got["skipped"] == want
    assert ranks[0]["skipped"] == {0: False, 1: True}


SPARSE = {"block_size": 32, "pattern": "random", "num_random": 1, "seed": 0,
          "layout": "contiguous"}  # fmt: skip


def _sparse_recount(rank: int) -> tuple[int, int]:
    """(rows received, rows wasted) of ring_block_sparse from its dense causal token pattern:
    rank 1's shard arrives at rank 0 only when some pair of them is kept (causal: never)."""
    twin = {k: v for k, v in SPARSE.items() if k != "layout"}
    blocks = BlockSparseAttention(attention.make_params("block_sparse", twin)).block_mask(S)
    keep = torch.kron(blocks.int(), torch.ones(32, 32, dtype=torch.int)).bool()
    keep &= torch.ones(S, S).tril().bool()
    n = S // WORLD
    sub = keep[rank * n : (rank + 1) * n][:, (1 - rank) * n : (2 - rank) * n]
    return (n, n - int(sub.any(0).sum())) if sub.any() else (0, 0)


def test_ring_block_sparse_stores_the_shards_its_pattern_sends() -> None:
    """The shards its block plan computes with, their rows no kept pair uses wasted; in the
    forward exactly what the step clock saw arrive."""
    ranks = run_ranks(rank_run, WORLD, "ring_block_sparse", SPARSE)
    for rank, got in enumerate(ranks):
        rows, wasted = _sparse_recount(rank)
        assert (got["comm"], got["wasted"]) == (2 * rows * ROW, 2 * wasted * ROW)
        assert got["received"] == [rows * ROW] * len(got["received"])
    assert ranks[1]["comm"] > 0 and ranks[0]["comm"] == 0


def test_ring_dilated_stores_its_segment_gathers() -> None:
    """Segments of 320 tokens at rate 2 over two heads (one group each): the segment [0, 320)
    spans both shards of 256; each rank receives the other's rows of each offset (its one
    kv head), the forward's as the step clock counted them. Causal: rank 0 precedes rank 1,
    so every row it receives is wasted and none of rank 1's."""
    params = {"segment_lengths": (128, 320), "dilation_rates": (1, 2)}
    ranks = run_ranks(rank_run, WORLD, "ring_dilated", params)
    others = {0: 320 - 256, 1: 256}  # rows of the segment the other rank holds
    for rank, got in enumerate(ranks):
        assert got["comm"] == 2 * others[rank] * ROW
        assert got["wasted"] == (got["comm"] if rank == 0 else 0)
        assert got["received"] == [others[rank] * ROW] * len(got["received"])


ULYSSES_RUNS = [("ulysses", {"mask": DOCS}), ("usp", {"mask": DOCS, "ulysses_degree": 2})]


@pytest.mark.parametrize(("kernel", "params"), ULYSSES_RUNS)
def test_ulysses_stores_the_kv_of_its_all_to_all(kernel: str, params: dict[str, Any]) -> None:
    """The other rank's shard for its one key/value head (one kv head replicated to two);
    every row is kept by a query of the whole sequence (causal documents: each key by
    itself). Its forward also moves q and the output as many bytes (two heads, one a rank):
    the step clock saw twice the K/V arrive."""
    ranks = run_ranks(rank_run, WORLD, kernel, params)
    n = S // WORLD
    for got in ranks:
        assert (got["comm"], got["wasted"]) == (2 * n * ROW, 0)
        assert got["received"] == [2 * n * ROW] * len(got["received"])


def test_a_kernel_that_does_not_count_stores_none() -> None:
    result = protocol.run_case(config(params={"mask": DOCS}, causal=True)).result
    assert (result.comm_bytes, result.wasted_comm_bytes) == (None, None)
