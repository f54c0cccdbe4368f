"""What every kernel on a sharded sequence shares: joining the call across the process group,
counting this rank's FLOPs from the pairs it computes, and the facts its KernelSpec declares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attention.base import Kernel, attention_flops, check_qkv
from attention.errors import ParamError
from attention.layouts import BALANCES, check_layout
from attention.layouts import positions as layout_positions
from attention.registry import CommOverlap, KernelSpec
from attention.ring.comm import check_backend, check_same_call, rank_and_world, resolve_group

ALL_BALANCES = frozenset(BALANCES)
"""Every balance (attention.layouts.BALANCES): what the ring kernels that weigh a mask take."""


@dataclass(frozen=True)
class HeadShape:
    """The heads a K/V count needs: `num_heads` query heads (a kernel whose messages follow
    head groups reads them), `kv_heads` key/value heads of `head_bytes` bytes a token each."""

    num_heads: int
    kv_heads: int
    head_bytes: int

    def row(self, kv_heads: int) -> int:
        """Bytes of one token's K and V rows of `kv_heads` key/value heads."""
        return 2 * kv_heads * self.head_bytes


def check_group(group: Any) -> None:
    """Raise ValueError unless `group` is None (the world) or a torch.distributed ProcessGroup."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ParamError(
            "params.group", f"expected a torch.distributed ProcessGroup or None, got {group!r}"
        )


def check_placement(layout: str | None, group: Any) -> None:
    """The checks of a sharded kernel's own two params: `layout` None or a known layout
    (attention.layouts), `group` None or a process group."""
    if layout is not None:
        check_layout(layout)
    check_group(group)


def default_layout(layout: str | None, causal: bool) -> str:
    """The layout in force: `layout`, or zigzag when causal and contiguous otherwise."""
    if layout is not None:
        return layout
    return "zigzag" if causal else "contiguous"


class ShardedKernel(Kernel):
    """A kernel on this rank's shard of a sequence sharded over `params.group` (None: the
    world), in `params.layout` (None: `default_layout`)."""

    params: Any

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Global positions of the tokens rank `rank` must pass, in its local order."""
        layout = default_layout(self.params.layout, causal)
        return layout_positions(seq_len, layout, rank, world_size)

    def join(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        check: Callable[[int], None] | None = None,
    ) -> tuple[Any, int, int]:
        """(group, rank, world) of this call, once every rank of the group is known to make the
        same call on inputs that pass check_qkv and `check(world)` (check_same_call)."""
        group = resolve_group(self.params.group)
        check_backend(group, q.device)
        world = dist.get_world_size(group)

        def local_check() -> None:
            check_qkv(q, k, v)
            if check is not None:
                check(world)

        check_same_call(group, q, causal, self.params, local_check=local_check)
        return group, dist.get_rank(group), world

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """FLOPs of this rank for a local shard of `seq_len` tokens: the pairs it computes."""
        rank, world = rank_and_world(self.params.group)
        pairs = self.rank_pairs(seq_len, num_heads, causal, rank, world)
        return attention_flops(batch * pairs, head_dim, backward=backward)

    def rank_pairs(self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int) -> int:
        """Query-key pairs rank `rank` of `world` computes on a local shard of `seq_len`
        tokens, summed over `num_heads` heads (one batch row)."""
        raise NotImplementedError

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """(received, wasted): bytes of K/V rank `rank` receives in one forward pass on a local
        shard of `seq_len` tokens (one batch row, `heads`), and of those the bytes of the rows
        none of its queries keeps a pair with (attention.ring.needed). None: the kernel does
        not count them."""
        return None


SHARDED_FACTS: dict[str, Any] = {
    "default_layout": default_layout,
    "comm_overlap": CommOverlap.OVERLAPPED,
}
"""The KernelSpec fields a ring-family kernel takes unless its registration names its own."""


def sharded_spec(
    name: str,
    description: str,
    params: type,
    factory: type[ShardedKernel],
    check: Callable[..., None],
    twin: str,
    **facts: Any,
) -> KernelSpec:
    """The KernelSpec of a ring-family kernel: distributed, its blocks computed by the primitive,
    `twin` its single-process twin, SHARDED_FACTS unless `facts` (its other KernelSpec fields,
    by name) says otherwise. One place for what the family shares, so that each registration
    states only what is its own."""
    family: dict[str, Any] = {"distributed": True, "primitive": True, "check": check, "twin": twin}
    return KernelSpec(name, description, params, factory, **family, **(SHARDED_FACTS | facts))
