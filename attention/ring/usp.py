"""`usp`: the 2D hybrid (yunchang's USP, TransformerEngine's a2a+p2p, LoongTrain's double ring):
Ulysses inside each group of U = `params.ulysses_degree` ranks, a ring of K/V across the
R = W / U groups.

Ranks g U .. g U + U - 1 form Ulysses group g (consecutive ranks: the gang orders ranks by node,
so a group sits within a node whenever U divides the ranks per node). The all-to-all gives each
rank its group's tokens for H / U heads; those tokens are the group's shard of a ring of R
ranks in the same layout:
- contiguous: rank r holds tokens [r S / W, (r + 1) S / W) (as every contiguous kernel), so
  group g holds [g S / R, (g + 1) S / R), in member order;
- zigzag: rank r holds zigzag chunks r and 2W-1-r (attention.layouts), so group g holds ring
  chunks g and 2R-1-g of the zigzag at R ranks, once its members' halves are put in order.
Ring member g of a head slice i is rank g U + i: R rings of R ranks run side by side, each the
`ring` engine's loop (K/V pieces travel, dK/dV come home).

K/V a rank receives (kv_comm_bytes): the all-to-all's U - 1 members' shards and the ring's
R - 1 groups' tokens, both of its H_kv / U key/value heads.

Step clock: the ring's steps are steps 0 .. R - 1 of each phase (and backward step R, the
last dK/dV home); forward step 0 also holds the all-to-all of q, k, v, forward step R the
output's; backward step 0 also holds the output gradient's, backward step R + 1 those of dq,
dk, dv (steps of one index add up).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from attention import layouts, primitive
from attention.base import KernelMemory, qkv_bytes
from attention.errors import ParamError
from attention.layouts import check_seq_len
from attention.mask.takes import (
    ALL_MASKS,
    check_causal,
    check_fits,
    kernel_balance,
    kernel_mask,
)
from attention.registry import CommOverlap, register
from attention.ring.allgather import check_sp_layout
from attention.ring.collectives import heads_of, tokens_of
from attention.ring.comm import rank_and_world
from attention.ring.dense import dense_plan
from attention.ring.engine import PIECE_BYTES, Block, piece_size, ring_attention
from attention.ring.mask_plan import mask_in_force, mask_plan, token_order, uses_mask_plan
from attention.ring.needed import kept_keys, traffic
from attention.ring.sharded import (
    ALL_BALANCES,
    HeadShape,
    ShardedKernel,
    check_group,
    default_layout,
    sharded_spec,
)
from attention.ring.steps import clock
from attention.ring.ulysses import check_heads, replicate_kv


@dataclass(frozen=True)
class UspParams:
    """ulysses_degree: U, ranks per Ulysses group (W = U x ring degree); layout: contiguous |
    zigzag (None: zigzag when causal, else contiguous); group: the process group."""

    ulysses_degree: int = 2
    layout: str | None = None
    group: Any = dataclasses.field(default=None, compare=False)
    mask: Any = None
    balance: str | None = None

    def __post_init__(self) -> None:
        u = self.ulysses_degree
        if isinstance(u, bool) or not isinstance(u, int) or u < 1:
            raise ParamError("params.ulysses_degree", f"must be an integer >= 1, got {u!r}")
        check_sp_layout(self.layout)
        check_group(self.group)
        object.__setattr__(self, "mask", kernel_mask(self.mask, "usp", ALL_MASKS))
        object.__setattr__(self, "balance", kernel_balance(self.balance, "usp", ALL_BALANCES))
        if self.balance is not None and self.layout is not None:
            raise ParamError(
                "params.layout", "a balance sets the shards' order; leave layout unset"
            )

    def ring_order(self, seq_len: int, world: int, causal: bool | None) -> torch.Tensor | None:
        """The tokens of the ring's concatenated shards when the mask plan runs (None: the
        layouts' own plan). A balance's order at W ranks is also its order at R = W / U ring
        members (group g's all-to-all gathers its members' consecutive shards); without one,
        the ring holds the layout in force at R ranks."""
        if not uses_mask_plan(self.mask, self.balance):
            return None
        mask = mask_in_force(self.mask, causal)
        if self.balance is not None:
            return layouts.order(self.balance, seq_len, world, mask)
        layout = default_layout(self.layout, True if causal is None else causal)
        return token_order(mask, None, layout, seq_len, world // self.ulysses_degree)


def check_degree(params: UspParams, world_size: int) -> None:
    """Raise ParamError unless U divides the world size."""
    if world_size % params.ulysses_degree:
        raise ParamError(
            "params.ulysses_degree",
            f"{params.ulysses_degree} must divide world_size {world_size} "
            "(W = ulysses_degree x ring degree)",
        )


def group_order(layout: str, u: int, n: int) -> torch.Tensor | None:
    """Rows of the all-to-all's output (members' shards in member order, n rows each) in the
    ring layout's local order; None when that is already the order (contiguous, or U = 1)."""
    if layout == "contiguous" or u == 1:
        return None
    c = n // 2  # member i's halves: zigzag chunks gU+i (first) and 2W-1-gU-i (second)
    first = [i * n + t for i in range(u) for t in range(c)]
    second = [i * n + c + t for i in reversed(range(u)) for t in range(c)]
    return torch.tensor(first + second)


class UspAttention(ShardedKernel):
    """Exact attention on this rank's shard: Ulysses within its group, a ring across groups."""

    world_size: int | None = None
    """The ranks `memory_model` assumes (a prediction made before any process group exists
    sets it: workers.model_memory); None: the process group's."""

    def __init__(self, params: UspParams | None = None) -> None:
        super().__init__(params or UspParams())

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """One call on this rank's shard of `seq_len` tokens: the ring (attention.autograd)
        saves the head-layout q, k, v the all-to-all made (one shard's bytes each), its
        output in that layout and the fp32 lse, not the caller's q, k, v nor the returned
        output. Forward transient: the fp32 accumulator when the dtype is narrower, the ring's
        piece buffers (ring_piece_bytes), or the output's return (zigzag's reordered copy and
        the all-to-all's send and receive buffers), whichever is larger. Backward transient:
        the output gradient in head layout, the fp32 dq, dk, dv and the ring's pieces."""
        world = self.world_size or rank_and_world(self.params.group)[1]
        u = self.params.ulysses_degree
        one = qkv_bytes(batch, seq_len, num_heads, head_dim, dtype_bytes)
        fp32 = qkv_bytes(batch, seq_len, num_heads, head_dim, 4)
        layout = default_layout(self.params.layout, True)
        fold = layout == "zigzag"  # causal zigzag cuts folded pieces (the larger case)
        rows, heads = seq_len * u, num_heads // u
        fwd, bwd = ring_piece_bytes(batch, rows, heads, head_dim, dtype_bytes, world // u, fold)
        back = (3 if fold else 2) * one if u > 1 else 0
        return KernelMemory(
            saved=4 * one + 4 * batch * num_heads * seq_len,
            output_saved=u == 1,
            forward_transient=max(fwd + (fp32 if dtype_bytes < 4 else 0), back),
            backward_transient=(one if u > 1 else 0) + 3 * fp32 + bwd,
            inputs_saved=u == 1,
        )

    def _setup(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):  # type: ignore[no-untyped-def]
        u = self.params.ulysses_degree

        def check(world: int) -> None:
            check_degree(self.params, world)
            check_heads(q.shape[2], k.shape[2], u, "params.ulysses_degree")

        check_causal(self.params.mask, causal)
        group, rank, world = self.join(q, k, v, causal, check)
        layout = default_layout(self.params.layout, causal)
        check_order(self.params, q.shape[1] * world, world, causal)
        return group, rank, world, u, layout

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        group, rank, world, u, layout = self._setup(q, k, v, causal)
        self.backend = primitive.backend_for(q.device, q.dtype)
        g, ring = rank // u, world // u
        members = tuple(g * u + i for i in range(u))
        k, v = replicate_kv(k, u), replicate_kv(v, u)
        with clock.step("forward", 0):
            qh, kh, vh = (heads_of(t, members, rank, group, ring + 1) for t in (q, k, v))
        ring_order = self.params.ring_order(q.shape[1] * world, world, causal)
        balanced = self.params.balance is not None  # members' shards already in ring order
        order = None if balanced else group_order(layout, u, q.shape[1])
        if order is not None:
            qh, kh, vh = (t[:, order] for t in (qh, kh, vh))
        m = qh.shape[1]
        plan = self.memo(
            ("plan", causal, g, ring, world, m), lambda: self._plan(causal, g, ring, m, ring_order)
        )
        ring_members = tuple(j * u + rank % u for j in range(ring))
        fold = causal and layout == "zigzag" and ring_order is None
        out = ring_attention(
            qh, kh, vh, plan, group if ring > 1 else None, q.shape[-1] ** -0.5, fold, ring_members
        )
        if order is not None:
            out = out[:, torch.argsort(order)]
        with clock.step("forward", ring):
            return tokens_of(out, members, rank, group, 0)

    def _plan(
        self, causal: bool, g: int, ring: int, m: int, ring_order: torch.Tensor | None
    ) -> list[list[Block]]:
        """Ring member g's plan over m tokens a member: the mask plan on `ring_order`, else
        the layout's dense_plan."""
        if ring_order is None:
            return dense_plan(default_layout(self.params.layout, causal), causal, g, ring, m)
        return mask_plan(mask_in_force(self.params.mask, causal), ring_order, g, ring)

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Global positions of the tokens rank `rank` holds: a balance's order, else the
        layout's."""
        if self.params.balance is None:
            return super().local_positions(seq_len, rank, world_size, causal=causal)
        n = seq_len // world_size
        mask = mask_in_force(self.params.mask, causal)
        return layouts.order(self.params.balance, seq_len, world_size, mask)[
            rank * n : (rank + 1) * n
        ]

    def rank_pairs(self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int) -> int:
        """Its ring plan's pairs over its group's U x seq_len tokens for H / U heads."""
        u = self.params.ulysses_degree
        ring_order = self.params.ring_order(seq_len * world, world, causal)
        plan = self._plan(causal, rank // u, world // u, seq_len * u, ring_order)
        return num_heads * sum(b.pairs() for step in plan for b in step) // u

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """Both parts, for this rank's H_kv / U key/value heads (at least one: replicate_kv),
        the rows its group's queries (every token of the group, its H / U heads) do not keep
        wasted: the Ulysses all-to-all of k and v brings the other U - 1 members' shards, and
        as ring member g = rank // U it receives the other R - 1 groups' U x seq_len tokens."""
        u, ring = self.params.ulysses_degree, world // self.params.ulysses_degree
        g = rank // u
        mask = mask_in_force(self.params.mask, causal)
        order = self.params.ring_order(seq_len * world, world, causal)
        if order is None:
            layout = default_layout(self.params.layout, causal)
            order = token_order(mask, None, layout, seq_len * world, ring)
        rows = traffic(mask, order, g, ring, "all")
        kept = kept_keys(mask, order, g, ring)
        group = order[g * u * seq_len : (g + 1) * u * seq_len].long()
        mine = self.local_positions(seq_len * world, rank, world, causal=causal).long()
        members = (u - 1) * seq_len
        unkept = members - (int(kept[group].sum()) - int(kept[mine].sum()))
        row = heads.row(max(heads.kv_heads, u) // u)  # its H_kv / U heads
        return (rows.received + members) * row, (rows.wasted + unkept) * row


def ring_piece_bytes(
    batch: int, rows: int, heads: int, dim: int, dtype_bytes: int, ring: int, fold: bool
) -> tuple[int, int]:
    """(forward, backward) bytes of the ring engine's own buffers on a shard of `rows` tokens
    of `heads` heads on CPU (attention.ring.engine): K/V receive buffers (two on a ring of
    more than one rank, one more for a folded piece) and one block's fp32 partial output
    (PIECE_BYTES) forward; the same buffers of the backward's smaller pieces, two fp32 dK/dV
    accumulators of a piece and one block's fp32 dq, dk, dv backward."""
    n_bufs = 2 * (ring > 1) + fold
    p = piece_size(rows, torch.device("cpu"), parts=2 if fold else 1)
    fwd = n_bufs * 2 * batch * p * heads * dim * dtype_bytes + PIECE_BYTES
    row = batch * heads * dim * dtype_bytes
    pb = piece_size(rows, torch.device("cpu"), row, parts=2 if fold else 1)
    piece = batch * pb * heads * dim
    bwd = n_bufs * 2 * piece * dtype_bytes + (1 + (ring > 1)) * 2 * piece * 4 + 3 * piece * 4
    return fwd, bwd


def check_order(params: UspParams, seq_len: int, world_size: int, causal: bool | None) -> None:
    """seq_len splits over the ranks in the layout in force (with a balance: its own rules),
    and fits the mask."""
    placement = "contiguous" if params.balance is not None else params.layout  # order checks
    check_seq_len(
        seq_len, default_layout(placement, True if causal is None else causal), world_size
    )
    check_fits(params.mask, seq_len)
    params.ring_order(seq_len, world_size, causal)  # a balance's or the ring layout's rules


def check_usp(
    params: UspParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """U | W, U | num_heads, and seq_len splits over W ranks in the layout in force."""
    check_degree(params, world_size)
    check_heads(num_heads, num_heads, params.ulysses_degree, "params.ulysses_degree")
    check_order(params, seq_len, world_size, causal)


register(
    sharded_spec(
        "usp",
        "USP, the 2D hybrid: Ulysses all-to-all inside groups of ulysses_degree ranks, a "
        "ring of K/V across the groups (contiguous or zigzag).",
        UspParams,
        UspAttention,
        check_usp,
        twin="dense",
        comm_overlap=CommOverlap.ALL_TO_ALL_THEN_RING,
        masks=ALL_MASKS,
        balances=ALL_BALANCES,
        heads_check=lambda p, heads, kv, world: check_heads(
            heads, kv, p.ulysses_degree, "params.ulysses_degree"
        ),
    )
)
