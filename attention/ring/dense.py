"""`ring`: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds its shard (layout contiguous | zigzag | striped) of q, k, v; K/V travel the ring
and every step merges through the (out, lse) primitive. Causal: block pairs the mask removes
entirely are skipped; zigzag and striped give every rank the same work at every step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attention import documents, primitive
from attention.errors import ParamError
from attention.layouts import check_seq_len
from attention.mask.takes import (
    ALL_MASKS,
    check_causal,
    check_fits,
    check_no_lengths,
    kernel_balance,
    kernel_mask,
)
from attention.registry import BenchParams, register
from attention.ring.engine import Block, ring_attention
from attention.ring.mask_plan import mask_in_force, mask_plan, uses_mask_plan
from attention.ring.mask_plan import token_order as mask_token_order
from attention.ring.needed import shard_tokens, traffic
from attention.ring.sharded import (
    ALL_BALANCES,
    HeadShape,
    ShardedKernel,
    check_placement,
    default_layout,
    sharded_spec,
)


@dataclass(frozen=True)
class RingParams:
    """layout: contiguous | zigzag | striped (None: zigzag when causal, else contiguous);
    group: the process group (None: the default world group); document_lengths: documents
    packed into the sequence (attention.documents; contiguous layout only); mask: a run's mask
    (attention.mask.parse), any kind; balance: the shards' token order (layouts.BALANCES,
    instead of a layout), weighed by the mask in force."""

    layout: str | None = None
    group: Any = dataclasses.field(default=None, compare=False)
    document_lengths: tuple[int, ...] | None = None
    mask: Any = None
    balance: str | None = None

    def __post_init__(self) -> None:
        check_placement(self.layout, self.group)
        object.__setattr__(self, "document_lengths", documents.normalize(self.document_lengths))
        object.__setattr__(self, "mask", kernel_mask(self.mask, "ring", ALL_MASKS))
        object.__setattr__(self, "balance", kernel_balance(self.balance, "ring", ALL_BALANCES))
        check_no_lengths(self.mask, self.document_lengths)
        if self.balance is not None and self.layout is not None:
            raise ParamError(
                "params.layout", "a balance sets the shards' order; leave layout unset"
            )


def check_ring(
    params: Any,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Raise ValueError unless seq_len splits over world_size ranks in the layout in force.

    Without an explicit layout that is zigzag when causal, contiguous when not, and the zigzag
    rule (seq_len % (2 x world_size)) when `causal` is not known (None).
    """
    placement = "contiguous" if params.balance is not None else params.layout  # order checks
    check_seq_len(seq_len, checked_layout(placement, causal), world_size)
    check_fits(params.mask, seq_len)
    if masked(params):
        token_order(params, seq_len, world_size, causal)  # its own rules (balance, layout)
    if params.document_lengths is not None:
        documents.check_total(params.document_lengths, seq_len)
        if not masked(params) and checked_layout(params.layout, causal) != "contiguous":
            raise ParamError(
                "params.layout",
                "packed documents (document_lengths) run on contiguous shards; set layout: "
                "contiguous, or a balance",
            )


def checked_layout(layout: str | None, causal: bool | None) -> str:
    """The layout whose split rule applies: `layout`, else the default for `causal`, else
    (causal unknown) zigzag, the stricter of the two defaults."""
    return default_layout(layout, True if causal is None else causal)


def document_plan(
    lengths: tuple[int, ...], causal: bool, rank: int, world: int, n: int
) -> list[list[Block]]:
    """Blocks per step for packed documents on contiguous shards: only the (query, key) pairs
    of one document; a step whose held keys share no document with this rank computes nothing
    (its K/V still travel on)."""
    plan: list[list[Block]] = []
    q_lo = rank * n
    for t in range(world):
        src = (rank - t) % world
        k_lo = src * n
        blocks = []
        if not (causal and src > rank):  # causal: a later rank's keys are all in the future
            for a, b in documents.bounds(lengths):
                qa, qb = max(a, q_lo), min(b, q_lo + n)
                ka, kb = max(a, k_lo), min(b, k_lo + n)
                if qa < qb and ka < kb:
                    diagonal = causal and src == rank  # the same rows: top-left causal
                    blocks.append(Block(qa - q_lo, qb - q_lo, ka - k_lo, kb - k_lo, diagonal))
        plan.append(blocks)
    return plan


def masked(params: RingParams) -> bool:
    """The ring runs the general mask plan (uses_mask_plan)."""
    return uses_mask_plan(params.mask, params.balance)


def token_order(params: RingParams, seq_len: int, world: int, causal: bool | None) -> Tensor:
    """The global token at each position of the concatenated shards (mask_plan.token_order)
    for the mask in force: params.mask, else the older spelling's."""
    mask = mask_in_force(params.mask, causal, params.document_lengths)
    layout = checked_layout(params.layout, causal)
    return mask_token_order(mask, params.balance, layout, seq_len, world)


def plan_for(
    params: RingParams, layout: str, causal: bool, rank: int, world: int, n: int
) -> list[list[Block]]:
    """The ring's plan: a mask's (mask_plan), packed documents' (document_plan) or exact
    attention's (dense_plan)."""
    if masked(params):
        order = token_order(params, n * world, world, causal)
        mask = mask_in_force(params.mask, causal, params.document_lengths)
        return mask_plan(mask, order, rank, world)
    if params.document_lengths is not None:
        return document_plan(params.document_lengths, causal, rank, world, n)
    return dense_plan(layout, causal, rank, world, n)


def dense_plan(layout: str, causal: bool, rank: int, world: int, n: int) -> list[list[Block]]:
    """Blocks per step for exact attention; step t holds the K/V of rank (rank - t) mod W."""
    plan: list[list[Block]] = []
    for t in range(world):
        src = (rank - t) % world
        if not causal:
            plan.append([Block(0, n, 0, n)])
        elif src == rank:  # same positions on both sides: the local order is increasing
            plan.append([Block(0, n, 0, n, causal=True)])
        elif layout == "contiguous":
            plan.append([Block(0, n, 0, n)] if src < rank else [])
        elif layout == "zigzag":
            c = n // 2  # chunks: mine r and 2W-1-r, held s and 2W-1-s
            if src < rank:  # both my chunks see chunk s, neither sees 2W-1-s
                plan.append([Block(0, n, 0, c)])
            else:  # only my late chunk sees anything, and it sees both held chunks
                plan.append([Block(c, n, 0, n)])
        elif src < rank:  # striped: key j*W+s <= query i*W+r  <=>  j <= i
            plan.append([Block(0, n, 0, n, causal=True)])
        else:  # striped, s > r: j < i
            plan.append([Block(1, n, 0, n - 1, causal=True)] if n > 1 else [])
    return plan


class RingAttention(ShardedKernel):
    """Exact attention on this rank's shard: `module(q, k, v, *, causal=False) -> out_local`."""

    def __init__(self, params: RingParams | None = None) -> None:
        super().__init__(params or RingParams())
        self.layout = self.params.layout

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_causal(self.params.mask, causal)
        group, rank, world = self.join(q, k, v, causal)
        layout = default_layout(self.layout, causal)
        if self.params.balance is None:
            check_seq_len(q.shape[1] * world, layout, world)
        self.backend = primitive.backend_for(q.device, q.dtype)
        if self.params.document_lengths is not None or self.params.mask is not None:
            check_ring(self.params, seq_len=q.shape[1] * world, world_size=world, causal=causal)
        n = q.shape[1]
        plan = self.memo(
            ("plan", layout, causal, rank, world, n),
            lambda: plan_for(self.params, layout, causal, rank, world, n),
        )
        q, k, v = (t.contiguous() for t in (q, k, v))
        group = group if world > 1 else None
        # balanced work per K/V piece (cut_pieces); the mask plan's pieces are contiguous
        fold = causal and layout == "zigzag" and not masked(self.params)
        return ring_attention(q, k, v, plan, group, q.shape[-1] ** -0.5, fold)

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> Tensor:
        """Global positions of the tokens rank `rank` holds: the mask plan's order, else the
        layout's."""
        if not masked(self.params):
            return super().local_positions(seq_len, rank, world_size, causal=causal)
        n = seq_len // world_size
        return token_order(self.params, seq_len, world_size, causal)[rank * n : (rank + 1) * n]

    def rank_pairs(self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int) -> int:
        """The pairs of this rank's ring plan (only the blocks it computes)."""
        plan = plan_for(
            self.params, default_layout(self.layout, causal), causal, rank, world, seq_len
        )
        return num_heads * sum(blk.pairs() for step in plan for blk in step)

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """Every other shard whole (the ring forwards each), its rows this rank's queries do
        not keep wasted (needed.traffic under gather all)."""
        mask = mask_in_force(self.params.mask, causal, self.params.document_lengths)
        layout = default_layout(self.layout, causal)
        order = shard_tokens(mask, self.params.balance, layout, seq_len * world, world)
        rows = traffic(mask, order, rank, world, "all")
        row = heads.row(heads.kv_heads)
        return rows.received * row, rows.wasted * row


register(
    sharded_spec(
        "ring",
        "Ring attention: exact attention over a sequence sharded across ranks (contiguous, "
        "zigzag or striped); K/V travel the ring, dK/dV travel home in the backward.",
        RingParams,
        RingAttention,
        check_ring,
        twin="dense",
        dense_baseline=True,
        bench_params=BenchParams(gpu={}),
        masks=ALL_MASKS,
        balances=ALL_BALANCES,
    )
)
