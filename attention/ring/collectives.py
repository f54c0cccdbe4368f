"""The collectives of the sequence-parallel schemes beyond the ring, timed and counted.

Ulysses and USP move heads for tokens with an all-to-all among a group of ranks (`to_heads`,
`to_tokens`, each the other's backward); allgather_kv gathers K and V (`all_gather`) and
reduce-scatters their gradients (`reduce_scatter`). Every one is blocking, so all of its time is
time blocked on communication in the step clock's open step (attention.ring.steps), and its
bytes count in `attention.ring.comm.traffic` and in that step, as a ring transfer's do.

The all-to-all is point-to-point among the group's members (comm.exchange), so a group needs
no torch subgroup: USP's Ulysses groups are lists of ranks every rank computes alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from attention.ring.comm import Tag, exchange, traffic, wait_all
from attention.ring.steps import clock

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch 2.13's names of the two collectives, or the older names of the same (torch < 2.13
has only those; 2.13 deprecates them)."""


def to_heads(x: torch.Tensor, members: Sequence[int], me: int, group: Any) -> torch.Tensor:
    """(B, n, H, D) tokens of all heads on each of the U `members` (group ranks, in sequence
    order) -> (B, U n, H / U, D): the members' tokens, in member order, of this rank's H / U
    heads (member i holds heads [i H / U, (i + 1) H / U))."""
    u = len(members)
    if u == 1:
        return x
    bsz, n, heads, dim = x.shape
    hl = heads // u
    # a view of any strides (it only splits the heads axis), then the one copy gloo needs
    parts = x.view(bsz, n, u, hl, dim).permute(2, 0, 1, 3, 4).contiguous()  # (U, B, n, hl, D)
    recv = _swap(parts, members, me, group)
    del parts  # freed before the layout copy below when B > 1, not after it
    return recv.transpose(0, 1).reshape(bsz, u * n, hl, dim)  # a view when B = 1


def to_tokens(y: torch.Tensor, members: Sequence[int], me: int, group: Any) -> torch.Tensor:
    """The inverse of `to_heads`: (B, U n, H / U, D) -> (B, n, H, D)."""
    u = len(members)
    if u == 1:
        return y
    bsz, total, hl, dim = y.shape
    n = total // u
    # a view of any strides (it only splits the sequence axis), then the one copy gloo needs
    parts = y.view(bsz, u, n, hl, dim).transpose(0, 1).contiguous()  # (U, B, n, hl, D)
    recv = _swap(parts, members, me, group)
    del parts  # freed before the layout copy below, not after it
    return recv.permute(1, 2, 0, 3, 4).reshape(bsz, n, u * hl, dim)


def _swap(parts: torch.Tensor, members: Sequence[int], me: int, group: Any) -> torch.Tensor:
    """The all-to-all: parts[m] (U, ...) goes to member m, and member m's part for this rank
    arrives in row m of the result (this rank's own part copied)."""
    recv = torch.empty_like(parts)
    i = members.index(me)
    recv[i].copy_(parts[i])
    sends = {j: parts[m] for m, j in enumerate(members) if j != me}
    recvs = {j: recv[m] for m, j in enumerate(members) if j != me}
    exchange(group, sends, recvs, Tag.ULYSSES)
    return recv


class _Swapped(torch.autograd.Function):
    """`there(x, members, me, group)` with its inverse `back` as its backward, timed as
    backward step `step`: `_Swapped.apply(x, there, back, members, me, group, step)`."""

    @staticmethod
    def forward(ctx, x, there, back, members, me, group, step):  # type: ignore[no-untyped-def]
        ctx.back, ctx.args, ctx.step = back, (members, me, group), step
        return there(x, members, me, group)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def]
        with clock.step("backward", ctx.step):
            return ctx.back(dy, *ctx.args), None, None, None, None, None, None


def heads_of(
    x: torch.Tensor, members: Sequence[int], me: int, group: Any, step: int
) -> torch.Tensor:
    """`to_heads` with `to_tokens` as its backward, timed as backward step `step`."""
    y: torch.Tensor = _Swapped.apply(x, to_heads, to_tokens, members, me, group, step)
    return y


def tokens_of(
    y: torch.Tensor, members: Sequence[int], me: int, group: Any, step: int
) -> torch.Tensor:
    """`to_tokens` with `to_heads` as its backward, timed as backward step `step`."""
    x: torch.Tensor = _Swapped.apply(y, to_tokens, to_heads, members, me, group, step)
    return x


def all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(W, *x.shape): every rank's x, in group rank order (blocking, timed and counted)."""
    world = dist.get_world_size(group)
    out = x.new_empty((world, *x.shape))
    if world == 1:
        out[0].copy_(x)
        return out
    posted = clock.mark()
    received = traffic.add(x, out[1:])  # W - 1 parts arrive
    with clock.waiting():
        flat = out.view(world * x.shape[0], *x.shape[1:])  # gloo wants dim 0 concatenated
        wait_all([_ALL_GATHER(flat, x.contiguous(), group=group, async_op=True)])
    clock.received(received, posted)
    return out


def reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x (W, ...) summed over the ranks, this rank's row (blocking, timed and counted); the
    bytes are a ring reduce-scatter's: (W - 1) / W of x sent and received."""
    world = dist.get_world_size(group)
    if world == 1:
        return x[0].clone()
    out = x.new_empty(x.shape[1:])
    posted = clock.mark()
    moved = x[1:]  # (W - 1) rows of x: what a ring reduce-scatter sends and receives
    received = traffic.add(moved, moved)
    with clock.waiting():
        flat = x.contiguous().view(world * x.shape[1], *x.shape[2:])
        wait_all([_REDUCE_SCATTER(out, flat, group=group, async_op=True)])
    clock.received(received, posted)
    return out
