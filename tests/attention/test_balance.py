"""layouts.order: every balance is a permutation with equal shards; none and head_tail are the
contiguous and zigzag layouts; head_tail, per_document and ptrr against torch's own context-
parallel load balancers (torch 2.13, _context_parallel/_load_balancer.py), each difference
explained where it is tested; kept pairs per rank and their imbalance against brute force."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from torch.nn.attention.flex_attention import create_block_mask

from attention import layouts
from attention.errors import ParamError
from attention.mask import expand, parse

pytestmark = pytest.mark.timeout(120)

MASKS = [
    {"kind": "full"},
    {"kind": "causal"},
    {"kind": "sliding_window", "causal": True, "window": 9},
    {"kind": "prefix_lm", "prefix": 40},
    {"kind": "documents", "causal": True, "lengths": [16, 48, 8, 56, 8, 120]},
    {"kind": "documents", "causal": False, "lengths": [32, 64, 160], "window": 20},
]
S = 256


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("balance", layouts.BALANCES)
@pytest.mark.parametrize("mask", MASKS, ids=[m["kind"] for m in MASKS])
def test_orders_are_permutations_and_pairs_add_up(
    mask: dict[str, Any], balance: str, world: int
) -> None:
    if balance == "per_document" and mask["kind"] != "documents":
        with pytest.raises(ParamError, match=r"^balance: per_document needs a documents mask"):
            layouts.order(balance, S, world, mask, block_size=8)
        return
    order = layouts.order(balance, S, world, mask, block_size=8)
    assert order.dtype == torch.int64
    assert torch.equal(order.sort().values, torch.arange(S))
    same = layouts.order(balance, S, world, parse(mask, S), block_size=8)  # a Mask, not a dict
    assert torch.equal(same, order)
    keep = parse(mask, S).dense(S)
    per_rank = layouts.rank_pairs(mask, order, world)
    want = torch.stack([keep[part].sum() for part in order.view(world, -1)])
    assert torch.equal(per_rank, want)
    assert int(per_rank.sum()) == parse(mask).pairs(S)
    assert layouts.imbalance(per_rank) == pytest.approx(float(want.max() / want.double().mean()))
    moved = keep[order][:, order].long()  # rows and columns in shard order
    for tile in (S // world, 8, 16):
        n = S // tile
        want_tiles = moved.view(n, tile, n, tile).sum((1, 3))
        assert torch.equal(layouts.tile_pairs(mask, order, tile), want_tiles)
    assert torch.equal(layouts.shard_pairs(mask, order, world).sum(1), per_rank)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_none_and_head_tail_are_the_contiguous_and_zigzag_layouts(world: int) -> None:
    for balance, layout in (("none", "contiguous"), ("head_tail", "zigzag")):
        got = layouts.order(balance, S, world, {"kind": "causal"})
        want = torch.cat([layouts.positions(S, layout, r, world) for r in range(world)])
        assert torch.equal(got, want)
        x = torch.randn(2, S, 3)
        shards = [layouts.shard(x, layout, r, world) for r in range(world)]
        assert torch.equal(torch.cat(shards, 1), x[:, got])


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_head_tail_is_torch_head_tail(world: int) -> None:
    torch_order = _HeadTailLoadBalancer(S, world, "cpu")._generate_indices()[0]
    assert torch.equal(layouts.order("head_tail", S, world, {"kind": "causal"}), torch_order.long())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_per_document_is_torch_per_document_grouped_by_rank(world: int) -> None:
    """torch's _PerDocumentHeadTailLoadBalancer emits, document after document, the head and
    tail chunk of rank 0, then rank 1, ...; _context_parallel_buffers then cuts that order into
    W contiguous shards, so in torch 2.13 each rank would hold whole documents, not their
    balanced head-tail picture its docstring draws (rank r: chunks r and 2W-1-r of every
    document). We hold the docstring's layout: the same pieces, grouped by rank. So ours is
    torch's order regrouped rank-major, and its causal pairs are exactly even."""
    lengths = [8 * world * n for n in (1, 3, 2, 1, 5)]
    seq = sum(lengths)
    mask = {"kind": "documents", "causal": True, "lengths": lengths}
    theirs = _PerDocumentHeadTailLoadBalancer([lengths], world, "cpu")._generate_indices()[0]
    per_doc = theirs.split(lengths)  # each: W x (head, tail), rank after rank
    want = torch.cat(
        [torch.cat([doc.view(world, -1)[rank] for doc in per_doc]) for rank in range(world)]
    )
    ours = layouts.order("per_document", seq, world, mask)
    assert torch.equal(ours, want)
    per_rank = layouts.rank_pairs(mask, ours, world)
    assert len(set(per_rank.tolist())) == 1
    if world > 1:  # torch's order, cut contiguously, is not balanced
        assert layouts.imbalance(layouts.rank_pairs(mask, theirs, world)) > 1.1


def test_ptrr_schedule_is_torch_ptrr_scheduling() -> None:
    """Same sort (descending, stable: ties in index order), same snake, same per-rank sort;
    torch's docstring example and random work with many ties."""
    example = torch.tensor([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    want = [[3, 12, 13, 14], [2, 4, 7, 9], [1, 8, 11, 15], [0, 5, 6, 10]]
    assert layouts.ptrr_schedule(example, 4).tolist() == want
    g = torch.Generator().manual_seed(0)
    for world in (1, 2, 3, 4, 8):
        for _ in range(20):
            work = torch.randint(0, 6, (world * 7,), generator=g)
            theirs = _PTRRLoadBalancer.ptrr_scheduling(work, world)
            assert torch.equal(layouts.ptrr_schedule(work, world), theirs)


def doc_block_mask(lengths: list[int], block: int) -> Any:
    """torch's BlockMask of causal documents, written as attention-gym writes it."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def mask_mod(b: Any, h: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (doc[q] == doc[k]) & (k <= q)

    seq = sum(lengths)
    return create_block_mask(mask_mod, 1, 1, seq, seq, device="cpu", BLOCK_SIZE=block)


@pytest.mark.parametrize(
    ("lengths", "block", "world"),
    [([256], 16, 4), ([64, 128, 32, 32], 8, 2), ([32, 96, 8, 120], 8, 4)],
)
def test_ptrr_is_torch_ptrr_on_block_aligned_masks(
    lengths: list[int], block: int, world: int
) -> None:
    """torch weighs a query block by its key blocks with any kept pair (kv_num_blocks +
    full_kv_num_blocks); we weigh it by its kept pairs. When documents start on block
    boundaries, a causal document's j-th block has j + 1 key blocks and j*b*b + b(b+1)/2 pairs:
    one weight is an increasing function of the other, so both sorts, ties included, agree."""
    mask = {"kind": "documents", "causal": True, "lengths": lengths}
    theirs = _PTRRLoadBalancer(doc_block_mask(lengths, block), world)._generate_indices()[0]
    assert torch.equal(layouts.order("ptrr", sum(lengths), world, mask, block_size=block), theirs)


def test_ptrr_differs_from_torch_where_blocks_straddle_documents() -> None:
    """Documents that end inside a block: a block's count of key blocks no longer follows its
    kept pairs (a block holding the start of one document and the end of another touches many
    key blocks but keeps few pairs). Weighing by the exact pairs balances better there."""
    for lengths, block, world in (([37, 100, 3, 61, 55], 8, 4), ([70, 150, 36], 8, 2)):
        mask = {"kind": "documents", "causal": True, "lengths": lengths}
        seq = sum(lengths)
        theirs = _PTRRLoadBalancer(doc_block_mask(lengths, block), world)._generate_indices()[0]
        ours = layouts.order("ptrr", seq, world, mask, block_size=block)
        assert not torch.equal(ours, theirs)
        assert torch.equal(ours.sort().values, theirs.sort().values)
        mine = layouts.imbalance(layouts.rank_pairs(mask, ours, world))
        torchs = layouts.imbalance(layouts.rank_pairs(mask, theirs, world))
        assert mine < torchs


def test_ptrr_balances_sampled_documents() -> None:
    """The benchmark's case: 16K tokens, W=4, causal documents with lognormal lengths of mean
    2K, none over a quarter of the sequence: ptrr's kept-pairs imbalance is <= 1.05, below
    none's and head_tail's."""
    seq, world = 16384, 4
    sampled = {"distribution": "lognormal", "mean": 2048, "max_fraction": 0.25}
    for seed in range(5):
        spec = {"kind": "documents", "causal": True, "sampled": {**sampled, "seed": seed}}
        mask = expand(spec, seq)
        got = {
            b: layouts.imbalance(
                layouts.rank_pairs(mask, layouts.order(b, seq, world, mask), world)
            )
            for b in ("none", "head_tail", "ptrr")
        }
        assert got["ptrr"] <= 1.05, (seed, got)
        assert got["ptrr"] < min(got["none"], got["head_tail"]), (seed, got)


def test_bad_balance_input_names_the_field() -> None:
    causal = {"kind": "causal"}
    docs = {"kind": "documents", "causal": True, "lengths": [8, 12, 12]}
    cases = [
        (("zigzag", 32, 2, causal), "balance", "must be one of"),
        (("none", 30, 4, causal), "seq_len", "world_size 4"),
        (("head_tail", 36, 4, causal), "seq_len", "2 x world_size = 8"),
        (("none", 32, 0, causal), "world_size", ">= 1"),
        (("per_document", 32, 4, docs), "mask.lengths", "be divisible by 2 x world_size = 8"),
        (("ptrr", 48, 2, causal), "seq_len", "block_size x world_size = 32"),
        (("none", 32, 2, {"kind": "prefix_lm", "prefix": 33}), "mask.prefix", "longer"),
        (("none", 32, 2, {**docs, "lengths": [8, 8]}), "mask.lengths", "sum to 16"),
    ]
    for args, path, reason in cases:
        with pytest.raises(ParamError) as caught:
            layouts.order(*args, block_size=16)
        assert ".".join(caught.value.path) == path, (args, str(caught.value))
        assert reason in caught.value.reason, (args, str(caught.value))
    with pytest.raises(ParamError, match=r"^block_size: expected an integer >= 1"):
        layouts.order("ptrr", 32, 2, causal, block_size=0)
