"""A ring plan for any mask on any token order: the (query, key) tiles of each step that keep a
pair, each cut into primitive calls.

A shard holds the tokens `order` puts at its positions (attention.layouts.order: a balance, or a
layout's positions). Both sides of a step are cut into runs of consecutive tokens; on a (query
run, key run) tile every query keeps one contiguous key range [lo, hi) (Mask.bounds), and lo and
hi never decrease from one query to the next, so the tile's rows fall into bands: rows that keep
nothing (skipped), rows keeping the same key range (a rectangle), rows whose range grows by one
key a row (a rectangle plus the primitive's causal square), and the rest, cut into chunks of
MASK_ROWS rows: per chunk the keys all its rows keep (fused), and the edges under the mask's
exact predicate (masked Blocks, attention.masked_block). No (S, S) tensor is built.
"""

from __future__ import annotations

from typing import Any

import torch

from attention import layouts
from attention.errors import ParamError
from attention.mask import Mask, from_legacy, parse
from attention.mask.takes import LEGACY_MASKS
from attention.ring.engine import Block

MIN_BAND_ROWS = 8
"""Shortest band of rows cut out as a rectangle or causal square; shorter stretches join the
neighbouring masked rows (one masked call beats many one-row fused calls)."""

Run = tuple[int, int, int]
"""(local start, local end, global token at the start): positions [start, end) hold consecutive
tokens."""


def runs(tokens: torch.Tensor) -> list[Run]:
    """The maximal runs of consecutive tokens in `tokens` (a shard's global indices)."""
    if tokens.numel() == 0:
        return []
    cuts = ((tokens[1:] != tokens[:-1] + 1).nonzero().flatten() + 1).tolist()
    starts, ends = [0, *cuts], [*cuts, tokens.numel()]
    return [(a, b, int(tokens[a])) for a, b in zip(starts, ends, strict=True)]


def _band(lo: list[int], hi: list[int], i: int) -> tuple[int, bool]:
    """The longest band of rows from i: (end, causal): rows keeping lo[i].. hi[i] (a
    rectangle) or lo[i] .. hi[i] + (row - i) (a causal band), whichever is longer."""
    m = len(lo)
    rect = i + 1
    while rect < m and lo[rect] == lo[i] and hi[rect] == hi[i]:
        rect += 1
    diag = i + 1
    while diag < m and lo[diag] == lo[i] and hi[diag] == hi[i] + (diag - i):
        diag += 1
    return (diag, True) if diag > rect else (rect, False)


def _fused(a: int, b: int, lo: int, hi: int, causal: bool) -> list[Block]:
    """Rows [a, b) keeping keys [lo, hi) (causal: hi grows by one a row) as primitive calls."""
    if not causal:
        return [Block(a, b, lo, hi)]
    edge = hi - 1  # every row keeps [lo, edge); the causal square starts at key `edge`
    blocks = [Block(a, b, lo, edge)] if edge > lo else []
    return [*blocks, Block(a, b, edge, edge + (b - a), causal=True)]


MASK_ROWS = 256
"""Rows of one masked block: a stretch of masked rows is cut into chunks this tall, each a
rectangle of the keys all its rows keep (fused) between two masked edges, so a sliding window's
masked work is its edges, not the window. Taller chunks mean fewer calls and more masked area:
on one CPU thread, 8K tokens, 4 heads of 64, a causal window of 512 ran in 0.60 s at 64 rows,
0.28 s at 128, 0.19 s at 256 (2048: 0.57, 0.46, 0.42 s)."""

Bounds = tuple[list[int], list[int], int, int]
"""A query run's global kept ranges: lo, hi per row, min(lo) and max(hi)."""


def run_bounds(mask: Mask, seq_len: int, q_run: Run) -> Bounds:
    """The kept key range of every query of a run (Mask.bounds), computed once per run."""
    a, b, qg = q_run
    lo_g, hi_g = mask.bounds(torch.arange(qg, qg + b - a), seq_len)
    lo, hi = lo_g.tolist(), hi_g.tolist()
    return lo, hi, min(lo), max(hi)


def _masked(
    mask: Mask, rows: tuple[int, int], lo: list[int], hi: list[int], offs: tuple[int, int, int]
) -> list[Block]:
    """A stretch of rows [r0, r1) of a tile (lo, hi: their kept keys, held-block-local) in
    chunks of MASK_ROWS: per chunk the keys every row keeps as one fused rectangle, the edges
    under the mask's predicate. `offs`: (the tile's first local row, Block.q_off, .k_off)."""
    blocks: list[Block] = []
    a, q_off, k_off = offs
    for r0 in range(rows[0], rows[1], MASK_ROWS):
        r1 = min(rows[1], r0 + MASK_ROWS)
        lo_min, lo_max = min(lo[r0:r1]), max(lo[r0:r1])
        hi_min, hi_max = min(hi[r0:r1]), max(hi[r0:r1])
        q0, q1 = a + r0, a + r1
        edges = [(lo_min, lo_max), (hi_min, hi_max)] if lo_max < hi_min else [(lo_min, hi_max)]
        if lo_max < hi_min and all(hi[r] == hi[r0] + (r - r0) for r in range(r0, r1)):
            blocks += _fused(q0, q1, lo_max, hi[r0], True)  # a causal right edge: fused too
            edges = edges[:1]
        elif lo_max < hi_min:
            blocks.append(Block(q0, q1, lo_max, hi_min))
        blocks += [
            Block(q0, q1, k0, k1, mask=mask, q_off=q_off, k_off=k_off)
            for k0, k1 in edges
            if k0 < k1
        ]
    return blocks


def tile_blocks(mask: Mask, bounds: Bounds, q_run: Run, k_run: Run) -> list[Block]:
    """The Blocks of one tile (local query rows of q_run, held keys of k_run) that keep a
    pair: rectangles, causal squares and masked blocks, exactly the mask's pairs. `bounds`:
    the run's kept ranges (run_bounds)."""
    a, _, qg = q_run
    c, d, kg = k_run
    lo_g, hi_g, lo_min, hi_max = bounds
    if hi_max <= kg or lo_min >= kg + (d - c):  # no query of the run keeps a key of the tile
        return []
    shift = c - kg
    lo = [min(max(x + shift, c), d) for x in lo_g]
    hi = [max(min(max(x + shift, c), d), y) for x, y in zip(hi_g, lo, strict=True)]
    blocks: list[Block] = []
    masked: int | None = None  # first row of the pending masked stretch
    offs = (a, qg - a, kg - c)  # local row a + r holds token qg + r, local key c + j token kg + j
    i = 0
    while i < len(lo):
        if hi[i] <= lo[i]:
            if masked is not None:
                blocks += _masked(mask, (masked, i), lo, hi, offs)
            masked = None
            i += 1
            continue
        end, causal = _band(lo, hi, i)
        if end - i >= MIN_BAND_ROWS or (masked is None and end == len(lo)):
            if masked is not None:
                blocks += _masked(mask, (masked, i), lo, hi, offs)
            masked = None
            blocks += _fused(a + i, a + end, lo[i], hi[i], causal)
            i = end
        else:
            masked = i if masked is None else masked
            i += 1
    if masked is not None:
        blocks += _masked(mask, (masked, len(lo)), lo, hi, offs)
    return blocks


def mask_plan(mask: Mask, order: torch.Tensor, rank: int, world: int) -> list[list[Block]]:
    """Blocks per step of rank `rank` when the shards hold `order` (step t holds the K/V of
    rank (rank - t) mod W): every tile of my queries and the held keys that keeps a pair; a
    step that keeps none computes nothing (its K/V still travel on)."""
    seq_len = order.numel()
    n = seq_len // world
    shards = [runs(order[r * n : (r + 1) * n]) for r in range(world)]
    mine = [(q_run, run_bounds(mask, seq_len, q_run)) for q_run in shards[rank]]
    plan = []
    for t in range(world):
        src = (rank - t) % world
        plan.append(
            [
                blk
                for q_run, bounds in mine
                for k_run in shards[src]
                for blk in tile_blocks(mask, bounds, q_run, k_run)
            ]
        )
    return plan


def gather_plan(
    mask: Mask, order: torch.Tensor, rank: int, world: int, keys: torch.Tensor | None = None
) -> list[Block]:
    """Blocks of rank `rank`'s queries against the gathered keys: every rank's rank-major (the
    gathered rows hold `order` itself), or the rows `keys` (their global tokens: gather
    needed's): the tiles that keep a pair, as in mask_plan."""
    n = order.numel() // world
    key_runs = runs(order if keys is None else keys)
    return [
        blk
        for q_run in runs(order[rank * n : (rank + 1) * n])
        for bounds in [run_bounds(mask, order.numel(), q_run)]
        for k_run in key_runs
        for blk in tile_blocks(mask, bounds, q_run, k_run)
    ]


def uses_mask_plan(mask: Any, balance: str | None) -> bool:
    """A sharded kernel runs the mask plan for a balance, or a mask (a dict or a Mask) other
    than full and causal (those run the layouts' own plans)."""
    return balance is not None or (mask is not None and parse(mask).kind not in LEGACY_MASKS)


def mask_in_force(mask: Any, causal: bool | None, document_lengths: Any = None) -> Mask:
    """The mask a kernel computes: its `mask` (a dict or a Mask), else the older spelling's
    (from_legacy)."""
    if mask is not None:
        return parse(mask)
    return parse(from_legacy(bool(causal), document_lengths))


def token_order(
    mask: Mask, balance: str | None, layout: str, seq_len: int, world: int
) -> torch.Tensor:
    """The global token at each position of the concatenated shards: the balance's order
    (layouts.order), else the positions of `layout` (the layout in force; striped, one token a
    run, is refused for the mask plan)."""
    if balance is not None:
        return layouts.order(balance, seq_len, world, mask)
    if layout == "striped":
        raise ParamError(
            "params.layout",
            f"striped shards hold no two consecutive tokens; the {mask.kind} mask runs on "
            "contiguous or zigzag shards, or with a balance",
        )
    return torch.cat([layouts.positions(seq_len, layout, r, world) for r in range(world)])
