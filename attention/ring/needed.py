"""Communication that follows the mask: which K/V rows a rank's queries keep a pair with, the
bytes a sharded kernel receives and wastes, and `allgather_kv`'s `gather: needed` exchange.

A rank *needs* a key token when at least one of its queries keeps a pair with it (the mask's
kept range of each query, Mask.bounds, is exact: every key in [lo, hi) is kept). The unit of
the accounting is one token's K/V row (all its key/value heads): a row is received whole or
not at all, so `needed`'s waste is zero at the granularity of one token's row, and the bytes
the mask needs are the rows it needs times the row's bytes.

Per forward pass a rank of W receives:
- `ring`, `allgather_kv` with `gather: all`: the W - 1 other shards, every row of them (a ring
  forwards every shard whatever its queries keep); their rows this rank does not need are
  wasted;
- `allgather_kv` with `gather: needed`: only the rows of the other shards it needs, sent by
  their owners in one variable all-to-all (MagiAttention's zero-redundant communication): the
  bytes its mask needs, nothing wasted;
- `ulysses` (and `usp`'s all-to-all inside its group): the other ranks' shards for its own
  key/value heads, wasted where none of the queries of its heads keeps a row;
- `ring_block_sparse`: only the shards its plan computes with (block_keys says which of their
  rows it keeps);
- `ring_dilated`: each shared segment's dilated rows of a head group (offset_kept for the
  relayout of zigzag or striped shards).

Every rank computes every rank's needs from the mask and the token order alone (no message
announces them), so sender and receiver agree on each message's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attention import layouts
from attention.mask import Mask
from attention.ring.comm import Tag, exchange
from attention.ring.engine import Block
from attention.segments import group_bounds

GATHERS = ("all", "needed")
"""allgather_kv's `gather`: every shard's K/V (all), or only the rows each rank's queries keep
a pair with (needed)."""


def shard_tokens(
    mask: Mask, balance: str | None, layout: str, seq_len: int, world: int
) -> torch.Tensor:
    """The global token at each position of the concatenated shards: the balance's order
    (layouts.order), else `layout`'s positions (striped included: only counted here)."""
    if balance is not None:
        return layouts.order(balance, seq_len, world, mask)
    return torch.cat([layouts.positions(seq_len, layout, r, world) for r in range(world)])


def kept_keys(mask: Mask, order: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """(S,) bool by global token: the keys at least one query of rank `rank` keeps."""
    seq_len = order.numel()
    n = seq_len // world
    lo, hi = mask.bounds(order[rank * n : (rank + 1) * n].long(), seq_len)
    rows = hi > lo
    edges = torch.zeros(seq_len + 1, dtype=torch.int64)
    edges.index_add_(0, lo[rows], torch.ones_like(lo[rows]))
    edges.index_add_(0, hi[rows], -torch.ones_like(hi[rows]))
    return edges.cumsum(0)[:seq_len] > 0


def needed_rows(mask: Mask, order: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    """Per source s, the local rows (int64, increasing) of s's shard whose keys rank `rank`
    needs (kept_keys)."""
    n = order.numel() // world
    need = kept_keys(mask, order, rank, world)
    return [need[order[s * n : (s + 1) * n].long()].nonzero().flatten() for s in range(world)]


def block_keys(blocks: Sequence[Block], keys: int) -> torch.Tensor:
    """(keys,) bool: the held key rows at least one of `blocks` computes a pair with (all of
    a full block's keys, the first min(rows, keys) of a top-left causal one's, a masked
    block's kept keys)."""
    kept = torch.zeros(keys, dtype=torch.bool)
    for blk in blocks:
        keep = blk.keep()
        if keep is not None:
            kept[blk.k0 : blk.k1] |= keep.any(0)
        elif blk.q1 > blk.q0:
            span = min(blk.q1 - blk.q0, blk.k1 - blk.k0) if blk.causal else blk.k1 - blk.k0
            kept[blk.k0 : blk.k0 + span] = True
    return kept


def offset_kept(branches: Iterable[tuple[int, int]], seq_len: int, num_heads: int) -> torch.Tensor:
    """(S,) bool: the positions some head keeps a pair with under LongNet's branches (w, r):
    a head of group g (attention.segments.group_bounds, inside any global_heads window)
    attends the rows at offset g of every segment, each at least with itself (causal too);
    offsets whose group holds none of the heads are attended by none."""
    offset = torch.arange(seq_len)
    kept = torch.zeros(seq_len, dtype=torch.bool)
    for w, r in branches:
        groups = torch.tensor([g for g, _, _ in group_bounds(num_heads, r)], dtype=torch.int64)
        kept |= torch.isin(offset % w % r, groups)
    return kept


@dataclass(frozen=True)
class KVTraffic:
    """K/V rows one rank receives in one forward pass: `received` rows, of them `wasted` kept
    by none of its queries; `needed`: the other shards' rows its queries keep."""

    received: int
    wasted: int
    needed: int


def traffic(mask: Mask, order: torch.Tensor, rank: int, world: int, gather: str) -> KVTraffic:
    """Rows rank `rank` receives under `gather` (all: every other shard whole, as a ring or
    an all-gather moves them; needed: only the rows it needs)."""
    n = order.numel() // world
    rows = needed_rows(mask, order, rank, world)
    needed = sum(r.numel() for s, r in enumerate(rows) if s != rank)
    if gather == "needed":
        return KVTraffic(received=needed, wasted=0, needed=needed)
    received = (world - 1) * n
    return KVTraffic(received=received, wasted=received - needed, needed=needed)


@dataclass(frozen=True)
class NeededPlan:
    """The `gather: needed` exchange of one rank: `send[d]` the local rows rank d needs from
    this shard, `recv[s]` how many rows arrive from rank s, `tokens` the global token of each
    row of the gathered keys (this rank's whole shard and the rows received, rank-major)."""

    rank: int
    send: list[torch.Tensor]
    recv: list[int]
    tokens: torch.Tensor


def needed_plan(mask: Mask, order: torch.Tensor, rank: int, world: int) -> NeededPlan:
    """This rank's exchange under `gather: needed` (every rank's needs from the mask)."""
    n = order.numel() // world
    mine = needed_rows(mask, order, rank, world)
    send = [
        needed_rows(mask, order, d, world)[rank] if d != rank else mine[rank][:0]
        for d in range(world)
    ]
    held = [torch.arange(n) if s == rank else mine[s] for s in range(world)]
    tokens = torch.cat([order[s * n : (s + 1) * n][held[s]] for s in range(world)])
    recv = [0 if s == rank else mine[s].numel() for s in range(world)]
    return NeededPlan(rank=rank, send=send, recv=recv, tokens=tokens)


def gather_needed(
    k: torch.Tensor, v: torch.Tensor, plan: NeededPlan, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, m, H, D) K and V of the gathered keys (NeededPlan.tokens): this rank's shard and
    the rows it needs of every other, received in one exchange (K and V stacked, one message
    per pair of ranks that has rows to move)."""
    bsz, _, heads, dim = k.shape
    device = k.device
    sends = {
        d: torch.stack((k[:, rows.to(device)], v[:, rows.to(device)]))
        for d, rows in enumerate(plan.send)
        if rows.numel()
    }
    recvs = {s: k.new_empty((2, bsz, m, heads, dim)) for s, m in enumerate(plan.recv) if m}
    if sends or recvs:
        exchange(group, sends, recvs, Tag.GATHER_NEEDED)
    parts = [
        torch.stack((k, v)) if s == plan.rank else recvs[s]
        for s in range(len(plan.recv))
        if s == plan.rank or s in recvs
    ]
    kv = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return kv[0], kv[1]


def return_grads(dkv: torch.Tensor, plan: NeededPlan, n: int, group: Any) -> torch.Tensor:
    """(2, B, n, H, D): this shard's dK/dV from the gathered keys' `dkv` (2, B, m, H, D): the
    rows of other shards go home to their owners, those other ranks computed for this shard's
    rows arrive and are added in."""
    world = len(plan.recv)
    starts = [0]
    for s in range(world):
        starts.append(starts[-1] + (n if s == plan.rank else plan.recv[s]))
    sends = {
        s: dkv[:, :, starts[s] : starts[s + 1]].contiguous()
        for s in range(world)
        if s != plan.rank and plan.recv[s]
    }
    shape = dkv.shape
    recvs = {
        d: dkv.new_empty((2, shape[1], rows.numel(), *shape[3:]))
        for d, rows in enumerate(plan.send)
        if rows.numel()
    }
    if sends or recvs:
        exchange(group, sends, recvs, Tag.GATHER_NEEDED_GRADS)
    own = dkv[:, :, starts[plan.rank] : starts[plan.rank + 1]].clone()
    for d, grads in recvs.items():
        own.index_add_(2, plan.send[d].to(own.device), grads)
    return own
