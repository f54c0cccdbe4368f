"""How a (batch, seq, ...) sequence is split over the ranks of a ring: contiguous, zigzag, striped;
and `order`, the load balancing of a mask's work as a token permutation (BALANCES).

- contiguous: rank r holds tokens [r*n, (r+1)*n) with n = seq / W.
- zigzag: the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r (causal balance).
- striped: rank r holds tokens r, r+W, r+2W, ... (Striped Attention, causal balance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from attention.errors import ParamError
from attention.mask import Documents, Mask
from attention.mask import parse as parse_mask

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    """Raise ValueError unless `layout` is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ParamError("params.layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def check_seq_len(seq_len: int, layout: str, world_size: int) -> None:
    """Raise ValueError unless `seq_len` tokens split evenly over `world_size` ranks."""
    check_layout(layout)
    if world_size < 1:
        raise ParamError("world_size", f"must be >= 1, got {world_size}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if seq_len % parts:
        what = f"2 x world_size = {parts}" if layout == "zigzag" else f"world_size {world_size}"
        raise ParamError("seq_len", f"{seq_len} must be divisible by {what} for layout {layout!r}")


def positions(seq_len: int, layout: str, rank: int, world_size: int) -> torch.Tensor:
    """Global positions (long, seq_len / W) of the tokens rank `rank` holds, in its local order."""
    check_seq_len(seq_len, layout, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    n = seq_len // world_size
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size)
    c = n // 2
    last = 2 * world_size - 1 - rank
    first = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([first, torch.arange(last * c, (last + 1) * c)])


def shard(x: torch.Tensor, layout: str, rank: int, world_size: int) -> torch.Tensor:
    """This rank's part (batch, seq / W, ...) of a full (batch, seq, ...) tensor (a copy)."""
    if x.dim() < 2:
        raise ValueError(f"x: expected (batch, seq, ...), got shape {tuple(x.shape)}")
    seq_len = x.shape[1]
    check_seq_len(seq_len, layout, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    n = seq_len // world_size
    if layout == "contiguous":
        return x[:, rank * n : (rank + 1) * n].clone()
    if layout == "striped":
        return x[:, rank::world_size].clone()
    c = n // 2
    last = 2 * world_size - 1 - rank
    return torch.cat([x[:, rank * c : (rank + 1) * c], x[:, last * c : (last + 1) * c]], dim=1)


def unshard(parts: Sequence[torch.Tensor], layout: str) -> torch.Tensor:
    """The full (batch, seq, ...) tensor from every rank's part, given in rank order."""
    check_layout(layout)
    world_size = len(parts)
    if world_size == 0:
        raise ValueError("parts: need at least one rank's part")
    shape = parts[0].shape
    for rank, part in enumerate(parts):
        if part.shape != shape:
            raise ValueError(
                f"parts[{rank}]: shape {tuple(part.shape)} differs from rank 0's {tuple(shape)}"
            )
    if len(shape) < 2:
        raise ValueError(f"parts: expected (batch, seq, ...), got shape {tuple(shape)}")
    n = shape[1]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"parts: zigzag parts hold two equal chunks; local seq {n} is odd")
    full = parts[0].new_empty((shape[0], n * world_size, *shape[2:]))
    for rank, part in enumerate(parts):
        full[:, positions(n * world_size, layout, rank, world_size).to(part.device)] = part
    return full


BALANCES = ("none", "head_tail", "per_document", "ptrr")
"""How `order` spreads a mask's work over the ranks (torch's context-parallel load balancers):
- none: contiguous shards (layout contiguous);
- head_tail: 2W chunks, rank r holds chunks r and 2W-1-r (layout zigzag);
- per_document: head_tail inside every document (each divisible by 2W); rank r holds, document
  after document, its head and tail chunk of each;
- ptrr: processing-time round robin: blocks of block_size tokens sorted by their kept pairs,
  heaviest first, dealt to the ranks in snake order (0..W-1, W-1..0, ...), each rank's blocks
  then in sequence order."""


def order(
    balance: str,
    seq_len: int,
    world_size: int,
    mask: dict[str, Any] | Mask,
    block_size: int = 128,
) -> torch.Tensor:
    """The global token index held at each position of the concatenated shards (long,
    (seq_len,)): rank r holds order[r * seq_len / W : (r + 1) * seq_len / W], in that order.
    `block_size` is ptrr's block; the other balances do not use it."""
    if balance not in BALANCES:
        raise ParamError("balance", f"must be one of {', '.join(BALANCES)}, got {balance!r}")
    check_seq_len(seq_len, "contiguous", world_size)
    mask = parse_mask(mask, seq_len)
    if balance == "none":
        return torch.arange(seq_len)
    if balance == "head_tail":
        check_seq_len(seq_len, "zigzag", world_size)
        return torch.cat([positions(seq_len, "zigzag", r, world_size) for r in range(world_size)])
    if balance == "per_document":
        return _per_document(mask, world_size)
    return _ptrr(mask, seq_len, world_size, block_size)


def _per_document(mask: Mask, world_size: int) -> torch.Tensor:
    """per_document's order: head_tail inside every document, rank after rank."""
    if not isinstance(mask, Documents):
        raise ParamError("balance", f"per_document needs a documents mask, got {mask.kind}")
    parts = 2 * world_size
    odd = [n for n in mask.lengths if n % parts]
    if odd:
        raise ParamError(
            "mask.lengths",
            f"balance per_document needs every document to be divisible by 2 x world_size = "
            f"{parts}; {len(odd)} do not (first: {odd[0]})",
        )
    starts = torch.tensor([0, *mask.lengths[:-1]]).cumsum(0).tolist()
    pieces = []
    for rank in range(world_size):
        for start, n in zip(starts, mask.lengths, strict=True):
            c = n // parts
            head, tail = start + rank * c, start + (parts - 1 - rank) * c
            pieces += [torch.arange(head, head + c), torch.arange(tail, tail + c)]
    return torch.cat(pieces)


def ptrr_schedule(work: torch.Tensor, world_size: int) -> torch.Tensor:
    """(W, n / W): the tasks (indices into work) each rank gets: sorted by work, heaviest
    first (ties in index order), dealt in snake order, each rank's in index order. The rule of
    torch's _PTRRLoadBalancer.ptrr_scheduling."""
    n = work.numel()
    if n % world_size:
        raise ValueError(f"work: {n} tasks do not divide over {world_size} ranks")
    heavy = torch.sort(work, descending=True, stable=True).indices.view(-1, world_size)
    heavy[1::2] = heavy[1::2].flip(1)
    return heavy.t().sort(dim=1).values


def _ptrr(mask: Mask, seq_len: int, world_size: int, block_size: int) -> torch.Tensor:
    """ptrr's order: blocks weighed by their kept pairs, dealt by ptrr_schedule."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ParamError("block_size", f"expected an integer >= 1, got {block_size!r}")
    if seq_len % (block_size * world_size):
        raise ParamError(
            "seq_len",
            f"{seq_len} must be divisible by block_size x world_size = {block_size * world_size} "
            "for balance ptrr",
        )
    work = mask.row_pairs(seq_len).view(-1, block_size).sum(1)
    blocks = ptrr_schedule(work, world_size).flatten()
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()


def rank_pairs(mask: dict[str, Any] | Mask, order_: torch.Tensor, world_size: int) -> torch.Tensor:
    """(W,) int64: kept pairs of each rank's queries when the shards hold `order_`."""
    seq_len = order_.numel()
    check_seq_len(seq_len, "contiguous", world_size)
    rows = parse_mask(mask, seq_len).row_pairs(seq_len)
    return rows[order_.long()].view(world_size, -1).sum(1)


def imbalance(per_rank: torch.Tensor) -> float:
    """max / mean of a per-rank quantity (1.0: perfectly even)."""
    mean = per_rank.double().mean()
    if not mean > 0:
        raise ValueError(f"per_rank: imbalance needs a positive mean, got {per_rank.tolist()}")
    return float(per_rank.double().max() / mean)


def tile_pairs(mask: dict[str, Any] | Mask, order_: torch.Tensor, tile_size: int) -> torch.Tensor:
    """(n, n) int64: kept pairs between the query tile i and the key tile j when the tokens
    sit in `order_` and are cut into tiles of tile_size positions (tile_size = seq_len / W: the
    ranks' shards; smaller: a ring's pieces). Zero: a step or piece with nothing to compute or
    to send. Exact, from each query's kept key range; O(n x S), no (S, S) tensor."""
    seq_len = order_.numel()
    if tile_size < 1 or seq_len % tile_size:
        raise ValueError(f"tile_size: must divide seq_len {seq_len}, got {tile_size}")
    n = seq_len // tile_size
    order_ = order_.long()
    lo, hi = parse_mask(mask, seq_len).bounds(order_, seq_len)
    tile_of_token = torch.empty(seq_len, dtype=torch.int64)
    tile_of_token[order_] = torch.arange(seq_len) // tile_size
    q_tile = torch.arange(seq_len) // tile_size
    out = torch.zeros(n, n, dtype=torch.int64)
    group = max(1, (1 << 22) // (seq_len + 1))  # key tiles counted at once: 32 MiB of int64
    for j0 in range(0, n, group):
        tiles = torch.arange(j0, min(j0 + group, n))
        held = torch.zeros(seq_len + 1, len(tiles), dtype=torch.int64)
        held[1:] = (tile_of_token[:, None] == tiles[None, :]).long().cumsum(0)
        out[:, j0 : j0 + len(tiles)].index_add_(0, q_tile, (held[hi] - held[lo]).clamp(min=0))
    return out


def shard_pairs(mask: dict[str, Any] | Mask, order_: torch.Tensor, world_size: int) -> torch.Tensor:
    """(W, W) int64: kept pairs between rank r's queries and rank s's keys (row r, column s):
    rank_pairs is its row sum; a zero entry is a ring step with no kept pair."""
    check_seq_len(order_.numel(), "contiguous", world_size)
    return tile_pairs(mask, order_, order_.numel() // world_size)
