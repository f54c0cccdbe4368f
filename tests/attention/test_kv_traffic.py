"""Each sharded kernel's count of the K/V bytes a rank receives in a forward pass and wastes
(kv_comm_bytes), recomputed from the dense mask or pattern over the tokens every rank holds
(local_positions): ring (every layout), allgather_kv under gather all and needed, usp's
all-to-all and ring (its groups' tokens, H_kv / U heads a rank), ulysses (its heads' queries
over the whole sequence), ring_block_sparse (the steps its pattern computes with) and
ring_dilated (each shared segment's head groups, and the relayout of zigzag or striped
shards)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _mask_cases import LENGTHS, MASKS, S, mask_id

import attention
from attention.block_sparse import BlockSparseAttention
from attention.hilbert import hilbert_permutation
from attention.layouts import positions
from attention.mask import parse
from attention.masks import dilated_branch_mask
from attention.ring.sharded import HeadShape

WORLD = 4
HEAD_BYTES = 16 * 4  # head_dim 16, float32
HEADS = 4
SMALL = 64  # tokens of the pattern kernels' cases (a power of 4: hilbert ordering)


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
        got = module.kv_comm_bytes(n, HeadShape(HEADS, 2, HEAD_BYTES), causal, rank, WORLD)
        assert got == (want[0] * row, want[1] * row), (rank, mask_id(mask))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "mask",
    [{"kind": "documents", "causal": True, "lengths": LENGTHS}, {"kind": "causal"}],
    ids=mask_id,
)
@pytest.mark.parametrize("balance", [None, "ptrr"])
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_usp_counts_its_all_to_all_and_its_ring_of_its_heads(
    balance: str | None, kv_heads: int, mask: dict[str, Any], world: int
) -> None:
    """The other members' shards (all-to-all) and the other groups' tokens (ring), of the rank's
    H_kv / U heads; wasted: the rows no token of its group keeps."""
    u = 2
    module = attention.build("usp", mask=mask, balance=balance, ulysses_degree=u)
    n = S // world
    held = [module.local_positions(S, r, world, causal=True) for r in range(world)]
    groups = [torch.cat(held[g * u : (g + 1) * u]) for g in range(world // u)]
    keep = parse(mask).dense(S)
    row = 2 * max(kv_heads, u) // u * HEAD_BYTES
    for rank in range(world):
        g = rank // u
        members = [held[j] for j in range(g * u, (g + 1) * u) if j != rank]
        others = [h for j, h in enumerate(groups) if j != g]
        rows, kept = _recount(keep, groups[g], members + others)
        got = module.kv_comm_bytes(n, HeadShape(HEADS, kv_heads, HEAD_BYTES), True, rank, world)
        assert got == (rows * row, (rows - kept) * row), rank
        assert rows == (u - 1) * n + (world // u - 1) * u * n


def _ulysses_keep(inner: str, params: dict[str, Any], causal: bool) -> torch.Tensor:
    """(H, S, S) keep by natural token from the inner kernel's own dense definition."""
    if inner == "dense":
        return parse(params["mask"]).dense(SMALL).expand(HEADS, SMALL, SMALL)
    if inner == "dilated":
        branches = zip(params["segment_lengths"], params["dilation_rates"], strict=True)
        masks = [dilated_branch_mask(SMALL, HEADS, w, r, causal=causal) for w, r in branches]
        keep = torch.stack(masks).any(0)
    else:
        keep = _block_keep(params, SMALL, causal).expand(HEADS, SMALL, SMALL)
    if params.get("ordering") != "hilbert":
        return keep
    perm = hilbert_permutation(SMALL)  # index i of the pattern is token perm[i]
    tokens = torch.empty_like(keep)
    tokens[:, perm[:, None], perm[None, :]] = keep
    return tokens


def _block_keep(params: dict[str, Any], seq_len: int, causal: bool) -> torch.Tensor:
    """(S, S) token keep of block_sparse's pattern (on the ordering's positions): its block
    mask expanded to tokens, and the token causal triangle when causal."""
    twin = {k: v for k, v in params.items() if k != "layout"}
    blocks = BlockSparseAttention(attention.make_params("block_sparse", twin)).block_mask(seq_len)
    bs = params["block_size"]
    keep = torch.kron(blocks.int(), torch.ones(bs, bs, dtype=torch.int)).bool()
    return keep & torch.ones(seq_len, seq_len).tril().bool() if causal else keep


ULYSSES_CASES = [
    ("dense", {"mask": {"kind": "documents", "causal": True, "lengths": [24, 8, 32]}}, True),
    ("dense", {"mask": {"kind": "sliding_window", "causal": False, "window": 4}}, False),
    ("dilated", {"segment_lengths": (16, 32), "dilation_rates": (2, 4)}, True),
    ("dilated", {"segment_lengths": (8,), "dilation_rates": (4,)}, False),
    ("dilated", {"segment_lengths": (16,), "dilation_rates": (4,), "ordering": "hilbert"}, False),
    ("block_sparse", {"block_size": 8, "pattern": "dilated", "window": 1, "dilation": 3}, False),
    ("block_sparse", {"block_size": 4, "pattern": "random", "num_random": 1, "seed": 3}, True),
    ("block_sparse", {"block_size": 4, "pattern": "random", "num_random": 1, "seed": 1,
                      "ordering": "hilbert"}, False),
]  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize(("inner", "params", "causal"), ULYSSES_CASES)
def test_ulysses_counts_the_other_shards_of_its_heads(
    inner: str, params: dict[str, Any], causal: bool, kv_heads: int, world: int
) -> None:
    """The all-to-all brings the other W - 1 shards of the rank's H_kv / W key/value heads (one,
    replicated, below W); wasted: the rows no query of its H / W heads keeps (every query of
    the sequence is the rank's for its heads)."""
    module = attention.build("ulysses", inner=inner, **params)
    keep = _ulysses_keep(inner, params, causal)
    n = SMALL // world
    row = 2 * max(kv_heads, world) // world * HEAD_BYTES
    for rank in range(world):
        heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world)
        kept = keep[heads].any(0).any(0)
        others = torch.cat([torch.arange(j * n, (j + 1) * n) for j in range(world) if j != rank])
        rows = others.numel()
        wasted = rows - int(kept[others].sum())
        got = module.kv_comm_bytes(n, HeadShape(HEADS, kv_heads, HEAD_BYTES), causal, rank, world)
        assert got == (rows * row, wasted * row), rank


def test_ulysses_wastes_the_rows_its_heads_do_not_attend() -> None:
    """Dilated inside, one branch of rate 4 over four heads: each rank's one head is one
    offset group, so three quarters of every other shard's rows reach a rank unattended."""
    module = attention.build("ulysses", inner="dilated", segment_lengths=(8,), dilation_rates=(4,))
    n = SMALL // WORLD
    row = 2 * HEAD_BYTES
    for rank in range(WORLD):
        got = module.kv_comm_bytes(n, HeadShape(HEADS, HEADS, HEAD_BYTES), False, rank, WORLD)
        assert got == (3 * n * row, 3 * n * 3 // 4 * row)


SPARSE_CASES = [
    {"block_size": 4, "pattern": "local_window", "window": 1},
    {"block_size": 4, "pattern": "dilated", "window": 1, "dilation": 3},
    {"block_size": 4, "pattern": "random", "num_random": 1, "seed": 5},
    {"block_size": 4, "pattern": "global_local", "window": 1, "num_global": 1},
    {"block_size": 4, "pattern": "random", "num_random": 2, "seed": 2, "ordering": "hilbert"},
]


def _case_id(params: dict[str, Any]) -> str:
    return "-".join(map(str, params.values()))


PLACEMENTS = [
    (layout, causal, world)
    for layout in ("contiguous", "zigzag", "striped")
    for causal in (False, True)
    for world in (2, 4)
]
"""(layout, causal, W) of the pattern kernels' cases."""


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize(("layout", "causal", "world"), PLACEMENTS)
@pytest.mark.parametrize("params", SPARSE_CASES, ids=_case_id)
def test_ring_block_sparse_counts_the_shards_its_pattern_computes_with(
    params: dict[str, Any], layout: str, causal: bool, kv_heads: int, world: int
) -> None:
    """Step t's shard (rank - t's) arrives whole when the dense token pattern keeps any pair
    of the rank's queries with it, and is not sent otherwise; wasted: its rows no query of
    the rank keeps."""
    module = attention.build("ring_block_sparse", layout=layout, **params)
    keep = _block_keep(params, SMALL, causal)  # on the ordering's positions, as the shards are
    n = SMALL // world
    held = [positions(SMALL, layout, r, world) for r in range(world)]
    row = 2 * kv_heads * HEAD_BYTES
    for rank in range(world):
        rows = wasted = 0
        for t in range(1, world):
            sub = keep[held[rank]][:, held[(rank - t) % world]]
            if sub.any():
                rows += n
                wasted += n - int(sub.any(0).sum())
        got = module.kv_comm_bytes(n, HeadShape(HEADS, kv_heads, HEAD_BYTES), causal, rank, world)
        assert got == (rows * row, wasted * row), rank


DILATED_CASES = [
    {"segment_lengths": (16, 32), "dilation_rates": (1, 4)},
    {"segment_lengths": (12, 40, 96), "dilation_rates": (2, 4, 8)},
    {"segment_lengths": (24,), "dilation_rates": (3,), "ordering": "hilbert"},
    {"segment_lengths": (18,), "dilation_rates": (4,)},  # W = 4: rank 1 holds two of its rows
]


def _dilated_recount(
    params: dict[str, Any], layout: str, causal: bool, kv_heads: int, rank: int, world: int
) -> tuple[int, int]:
    """(bytes, wasted bytes) from the dense per-branch, per-head pattern (dilated_branch_mask):
    per branch, segment that spans this rank's contiguous shard and another's, and head group,
    the group's rows (the positions its heads keep on the diagonal) held by the other ranks,
    for the group's kv heads, wasted where no query of the rank keeps them in that group's
    heads; plus, for zigzag or striped shards, the tokens of its contiguous shard held
    elsewhere, for every kv head, wasted where no query of the rank keeps them at all."""
    n = SMALL // world
    mine = torch.arange(rank * n, (rank + 1) * n)
    per_kv = HEADS // kv_heads
    half = 2 * HEAD_BYTES
    total = wasted = 0
    masks = []
    for w, r in zip(params["segment_lengths"], params["dilation_rates"], strict=True):
        keep = dilated_branch_mask(SMALL, HEADS, w, r, causal=causal)
        masks.append(keep)
        size = math.ceil(HEADS / r)
        for a in range(0, SMALL, w):
            seg = torch.arange(a, min(a + w, SMALL))
            owners = seg // n
            if not (owners == rank).any() or bool((owners == rank).all()):
                continue  # not this rank's, or local to it
            for g in range(r):
                heads = list(range(g * size, min((g + 1) * size, HEADS)))
                if not heads:
                    continue
                kv = len({h // per_kv for h in heads})
                ours = keep[heads][:, seg, seg].any(0)  # the diagonal: (H, w)
                theirs = seg[ours & (owners != rank)]
                used = keep[heads][:, mine][:, :, theirs].any(0).any(0)
                total += theirs.numel() * kv * half
                wasted += int((~used).sum()) * kv * half
    if layout != "contiguous":
        kept = torch.stack(masks).any(0).any(0)[mine].any(0)
        held = [positions(SMALL, layout, j, world) for j in range(world) if j != rank]
        elsewhere = torch.cat(held)
        moved = mine[torch.isin(mine, elsewhere)]
        total += moved.numel() * kv_heads * half
        wasted += int((~kept[moved]).sum()) * kv_heads * half
    return total, wasted


@pytest.mark.parametrize(("layout", "causal", "world"), PLACEMENTS)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("params", DILATED_CASES, ids=_case_id)
def test_ring_dilated_counts_its_segment_gathers_and_relayout(
    params: dict[str, Any], layout: str, causal: bool, kv_heads: int, world: int
) -> None:
    module = attention.build("ring_dilated", layout=layout, **params)
    n = SMALL // world
    for rank in range(world):
        want = _dilated_recount(params, layout, causal, kv_heads, rank, world)
        got = module.kv_comm_bytes(n, HeadShape(HEADS, kv_heads, HEAD_BYTES), causal, rank, world)
        assert got == want, rank
