"""Move a sharded sequence from one layout to another: one P2P all-to-all over the group.

A kernel that computes in one layout (ring_dilated: contiguous, where its segments are) can
then take and return shards in any layout. Each rank sends every peer exactly the tokens that
peer holds in the target layout, already in the peer's local order, so the receiver only places
them; both ends derive the routes from the layouts alone, so they always agree. The autograd
backward is the inverse move of the gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from attention.layouts import positions
from attention.ring.comm import Tag, wait_all


@functools.lru_cache(maxsize=16)
def _owners(seq_len: int, layout: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every global position: the rank holding it in `layout`, and its index there."""
    owner = torch.empty(seq_len, dtype=torch.long)
    index = torch.empty(seq_len, dtype=torch.long)
    n = seq_len // world
    for r in range(world):
        pos = positions(seq_len, layout, r, world)
        owner[pos] = r
        index[pos] = torch.arange(n)
    return owner, index


@functools.lru_cache(maxsize=16)
def routes(
    seq_len: int, src: str, dst: str, rank: int, world: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(send[p], recv[p]) for every peer p: the local indices (in `src` order) of the tokens
    this rank sends p, ordered as p holds them in `dst`; and the local indices (in `dst` order)
    where the tokens received from p go."""
    dst_owner, dst_index = _owners(seq_len, dst, world)
    src_owner, _ = _owners(seq_len, src, world)
    mine_src = positions(seq_len, src, rank, world)
    mine_dst = positions(seq_len, dst, rank, world)
    send, recv = [], []
    for peer in range(world):
        local = (dst_owner[mine_src] == peer).nonzero().flatten()
        send.append(local[dst_index[mine_src[local]].argsort()])
        recv.append((src_owner[mine_dst] == peer).nonzero().flatten())
    return send, recv


def _move(x: torch.Tensor, src: str, dst: str, group: Any) -> torch.Tensor:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send, recv = routes(x.shape[1] * world, src, dst, rank, world)
    out = torch.empty_like(x)
    out[:, recv[rank].to(x.device)] = x[:, send[rank].to(x.device)]
    ops, landed = [], []
    for peer in range(world):
        if peer == rank:
            continue
        global_peer = dist.get_global_rank(group, peer)
        if len(send[peer]):
            part = x[:, send[peer].to(x.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, part, global_peer, group, Tag.RELAYOUT))
        if len(recv[peer]):
            buf = x.new_empty((x.shape[0], len(recv[peer]), *x.shape[2:]))
            ops.append(dist.P2POp(dist.irecv, buf, global_peer, group, Tag.RELAYOUT))
            landed.append((recv[peer], buf))
    if ops:
        wait_all(dist.batch_isend_irecv(ops))
    for idx, buf in landed:
        out[:, idx.to(x.device)] = buf
    return out


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group):  # type: ignore[override]
        ctx.src, ctx.dst, ctx.group = src, dst, group
        return _move(x.contiguous(), src, dst, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _move(grad.contiguous(), ctx.dst, ctx.src, ctx.group), None, None, None


def relayout(x: torch.Tensor, src: str, dst: str, group: Any) -> torch.Tensor:
    """This rank's (batch, seq / W, ...) shard in layout `dst`, from its shard `x` in `src`
    (`group`: the ranks holding the sequence; None: the world)."""
    group = dist.group.WORLD if group is None else group
    if src == dst or dist.get_world_size(group) == 1:
        return x
    return _Relayout.apply(x, src, dst, group)
