"""flex_dilated's BlockMasks, built from the tiles each dilated branch keeps, never from a
(1, H, S, S) token mask.

torch's create_block_mask evaluates the mask_mod on every token pair of every head (eagerly,
a (1, H, S, S) bool: 64 GiB at h=16 and 64K tokens) and folds it into tiles. A dilated branch's
pattern is known per tile, so `branch_block_mask` computes the tiles directly:

- a "piece" is a run of positions inside one tile and one segment (the cuts are the multiples
  of the tile and of w, and S). Two tiles can keep a pair only through pieces of one segment.
- For head group g (heads h with h // ceil(H / r) == g) a piece's kept positions are its
  segment offsets o with o % r == g: the first and last of them are arithmetic, so a pair of
  pieces keeps some token pair when both hold a kept position (causal: the last kept query at
  or after the first kept key), and keeps every pair when both are whole tiles, every position
  is kept (r == 1) and (causal) the first query comes at or after the last key.
- A tile pair is full when a pair of its pieces keeps everything, partial when one keeps
  something otherwise, as create_block_mask decides (tiles past the sequence's end are never
  full: it pads with dropped pairs).

Heads of one group share their tiles: each group's index lists are sorted once and written to
its heads, so the build holds the BlockMask's own tensors plus one group's (T, T) grids, where
T = ceil(S / tile). The result equals create_block_mask's element for element (the tests
compare every tensor), with the same mask_mod, which flex's kernels apply inside partial tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

TILE = 128
"""Tokens per BlockMask tile: create_block_mask's default, which flex's kernels are tuned for."""


def dilated_mask_mod(w: int, r: int, g: int, causal: bool) -> Any:
    """The mask_mod of dilated branch (w, r) whose head groups have g heads (LongNet's)."""

    def keep_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        group = h // g
        keep = (qi // w == ki // w) & ((qi % w) % r == group) & ((ki % w) % r == group)
        return keep & (qi >= ki) if causal else keep

    return keep_mod


@dataclass(frozen=True)
class _Pieces:
    """Every piece (a run of positions inside one tile and one segment), in order, and every
    ordered pair of pieces of one segment (the only pairs that can keep a token pair)."""

    start: Tensor  # (P,) int64: first position
    end: Tensor  # (P,) int64: one past the last
    q: Tensor  # (N,) int64: the query piece of each pair
    k: Tensor  # (N,) int64: its key piece
    cell: Tensor  # (N,) int64: the pair's tile, row * T + column

    @classmethod
    def of(cls, seq_len: int, w: int, tile: int, device: torch.device) -> _Pieces:
        """The pieces of segments of w tokens in tiles of `tile` tokens over seq_len."""
        cuts = torch.cat(
            [
                torch.arange(0, seq_len, tile, device=device),
                torch.arange(0, seq_len, w, device=device),
                torch.tensor([seq_len], device=device),
            ]
        )
        cuts = torch.unique(cuts)  # sorted
        start, end = cuts[:-1], cuts[1:]
        _, counts = torch.unique_consecutive(start // w, return_counts=True)
        per_piece = torch.repeat_interleave(counts, counts)  # pieces in each one's segment
        first_of = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        q = torch.repeat_interleave(torch.arange(start.numel(), device=device), per_piece)
        rank = torch.arange(q.numel(), device=device)  # each pair's rank among its query piece's
        rank -= torch.repeat_interleave(torch.cumsum(per_piece, 0) - per_piece, per_piece)
        k = first_of[q] + rank
        cell = start[q] // tile * -(-seq_len // tile) + start[k] // tile
        return cls(start, end, q, k, cell)


def _group_tiles(
    pieces: _Pieces, w: int, r: int, group: int, causal: bool, tile: int
) -> tuple[Tensor, Tensor]:
    """(partial, full) bool (T, T) tiles of head group `group` (module docstring)."""
    start, end, q, k = pieces.start, pieces.end, pieces.q, pieces.k
    seg_start = start // w * w
    a, b = start - seg_start, end - seg_start  # offsets in the segment, [a, b)
    first = a + (group - a) % r  # the first and last kept offsets (first >= b: none)
    last = (b - 1) - (b - 1 - group) % r
    has = first < b
    every = has & ((last - first) // r + 1 == b - a) & (end - start == tile)
    keep = has[q] & has[k]
    full = every[q] & every[k]
    if causal:
        keep &= last[q] >= first[k]
        full &= first[q] >= last[k]
    count = -(-int(end[-1]) // tile)
    grids = []
    for chosen in (keep, full):
        grid = torch.zeros(count, count, dtype=torch.bool, device=start.device)
        grid.view(-1)[pieces.cell[chosen]] = True
        grids.append(grid)
    kept, whole = grids
    return kept & ~whole, whole


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """(num (T,), indices (T, T)) int32 of bool (T, T) tiles in the BlockMask layout: each
    row's kept columns first, ascending, then the others, ascending (the order of torch's
    stable argsort, made here as a stable partition: a scatter, cheaper than a sort)."""
    kept = tiles.to(torch.int32)
    num = kept.sum(-1, dtype=torch.int32)
    before = torch.cumsum(kept, -1, dtype=torch.int32)  # kept columns up to and with this one
    column = torch.arange(1, tiles.shape[-1] + 1, dtype=torch.int32, device=tiles.device)
    slot = torch.where(tiles, before, num[:, None] + column - before) - 1
    order = torch.empty_like(slot)
    order.scatter_(-1, slot.long(), column.expand_as(slot) - 1)
    return num, order


def branch_block_mask(
    w: int, r: int, num_heads: int, seq_len: int, causal: bool, device: torch.device
) -> BlockMask:
    """The BlockMask of dilated branch (w, r) for `num_heads` heads at `seq_len` tokens, causal
    or not, on `device`: create_block_mask(dilated_mask_mod(...), None, num_heads, seq_len,
    seq_len) without its (1, H, S, S) mask (module docstring)."""
    g = math.ceil(num_heads / r)
    count = -(-seq_len // TILE)
    pieces = _Pieces.of(seq_len, w, TILE, device)
    kinds = ("kv", "full_kv", "q", "full_q")  # kv-major tiles, then q-major (the backward's)
    out: dict[str, Tensor] = {}
    for kind in kinds:
        out[f"{kind}_num_blocks"] = torch.empty(
            1, num_heads, count, dtype=torch.int32, device=device
        )
        out[f"{kind}_indices"] = torch.empty(
            1, num_heads, count, count, dtype=torch.int32, device=device
        )
    for group in range(-(-num_heads // g)):
        heads = slice(group * g, min((group + 1) * g, num_heads))
        partial, full = _group_tiles(pieces, w, r, group, causal, TILE)
        for kind, tiles in zip(kinds, (partial, full, partial.T, full.T), strict=True):
            num, idx = _ordered(tiles)
            out[f"{kind}_num_blocks"][0, heads] = num
            out[f"{kind}_indices"][0, heads] = idx
    return BlockMask(
        seq_lengths=(seq_len, seq_len),
        **out,
        BLOCK_SIZE=(TILE, TILE),
        mask_mod=dilated_mask_mod(w, r, g, causal),
    )
