"""`allgather_kv`: Llama-3-style context parallelism (torch's context_parallel with its
all-gather rotation; TransformerEngine's cp_comm_type=all_gather).

Each rank all-gathers K and V and computes its own queries (layout contiguous or zigzag; zigzag
balances causal work) against the whole sequence; the backward gathers K and V again (holding
them from the forward would keep the whole sequence's K/V per rank alive in between) and
reduce-scatters dK and dV home. Its K/V memory per rank grows with the whole length: 2 x S x
H_kv x D elements gathered, and in the backward the same again in fp32 for dK/dV before the
reduce-scatter (workers.model_memory says so).

`gather: needed` moves only the K/V rows a rank's queries keep a pair with (one variable
exchange, attention.ring.needed) instead of every shard, and sends their dK/dV home the same
way; `gather: all` (the default) is the all-gather above.

Step clock: forward step 0 is the gather and the compute; backward step 0 the gather, the
compute and the reduce-scatter (all blocking: the collectives' time is their wait).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from attention import primitive
from attention.autograd import bound_merged_attention
from attention.base import KernelMemory, merged_memory, qkv_bytes
from attention.errors import ParamError
from attention.layouts import check_seq_len
from attention.layouts import positions as layout_positions
from attention.mask import parse as parse_mask
from attention.mask.takes import (
    ALL_MASKS,
    check_causal,
    check_fits,
    kernel_balance,
    kernel_mask,
)
from attention.primitive import empty_result
from attention.registry import CommOverlap, register
from attention.ring.collectives import all_gather, reduce_scatter
from attention.ring.comm import rank_and_world
from attention.ring.engine import (
    Block,
    _row_bytes,
    piece_size,
    restrict,
    step_backward,
    step_forward,
)
from attention.ring.mask_plan import gather_plan as gather_mask_plan
from attention.ring.mask_plan import mask_in_force, token_order, uses_mask_plan
from attention.ring.needed import (
    GATHERS,
    KVTraffic,
    NeededPlan,
    gather_needed,
    needed_plan,
    return_grads,
    traffic,
)
from attention.ring.sharded import (
    ALL_BALANCES,
    HeadShape,
    ShardedKernel,
    check_group,
    default_layout,
    sharded_spec,
)
from attention.ring.steps import clock

LAYOUTS = ("contiguous", "zigzag")


def check_sp_layout(layout: str | None) -> None:
    """Raise ParamError unless `layout` is None (the default) or one of LAYOUTS."""
    if layout is not None and layout not in LAYOUTS:
        raise ParamError("params.layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")


@dataclass(frozen=True)
class AllGatherParams:
    """layout: contiguous | zigzag (None: zigzag when causal, else contiguous); group: the
    process group (None: the world); mask: a run's mask (attention.mask.parse), any kind;
    balance: the shards' token order (layouts.BALANCES, instead of a layout); gather: all
    (every shard's K/V) | needed (only the K/V rows this rank's queries keep a pair with)."""

    layout: str | None = None
    group: Any = dataclasses.field(default=None, compare=False)
    mask: Any = None
    balance: str | None = None
    gather: str = "all"

    def __post_init__(self) -> None:
        if self.gather not in GATHERS:
            raise ParamError(
                "params.gather", f"must be one of {', '.join(GATHERS)}, got {self.gather!r}"
            )
        check_sp_layout(self.layout)
        check_group(self.group)
        object.__setattr__(self, "mask", kernel_mask(self.mask, "allgather_kv", ALL_MASKS))
        balance = kernel_balance(self.balance, "allgather_kv", ALL_BALANCES)
        object.__setattr__(self, "balance", balance)
        if balance is not None and self.layout is not None:
            raise ParamError(
                "params.layout", "a balance sets the shards' order; leave layout unset"
            )

    def order(self, seq_len: int, world: int, causal: bool | None) -> torch.Tensor | None:
        """The shards' token order when the mask plan runs (uses_mask_plan), else None."""
        if not uses_mask_plan(self.mask, self.balance):
            return None
        layout = default_layout(self.layout, True if causal is None else causal)
        return token_order(mask_in_force(self.mask, causal), self.balance, layout, seq_len, world)

    def tokens(self, seq_len: int, world: int, causal: bool) -> torch.Tensor:
        """The shards' token order in every case: the mask plan's, else the layout's."""
        order = self.order(seq_len, world, causal)
        if order is not None:
            return order
        layout = default_layout(self.layout, causal)
        return token_order(mask_in_force(self.mask, causal), None, layout, seq_len, world)

    def needed(self, causal: bool, rank: int, world: int, n: int) -> NeededPlan | None:
        """`gather: needed`'s exchange of this rank (None under `gather: all`)."""
        return self._exchange(causal, rank, world, n) if self.gather == "needed" else None

    def _exchange(self, causal: bool, rank: int, world: int, n: int) -> NeededPlan:
        order = self.tokens(n * world, world, causal)
        return needed_plan(mask_in_force(self.mask, causal), order, rank, world)

    def blocks(
        self, causal: bool, rank: int, world: int, n: int, needed: NeededPlan | None = None
    ) -> list[Block]:
        """This rank's blocks against the gathered keys: the mask plan's or gather_plan's;
        under `gather: needed` against the rows `needed` gathers (self.needed's when None)."""
        if self.gather == "needed":
            needed = needed or self._exchange(causal, rank, world, n)
            tokens = self.tokens(n * world, world, causal)
            mask = mask_in_force(self.mask, causal)
            return gather_mask_plan(mask, tokens, rank, world, needed.tokens)
        order = self.order(n * world, world, causal)
        if order is None:
            return gather_plan(default_layout(self.layout, causal), causal, rank, world, n)
        return gather_mask_plan(mask_in_force(self.mask, causal), order, rank, world)

    def kv_traffic(self, causal: bool, rank: int, world: int, n: int) -> KVTraffic:
        """The K/V rows this rank receives in one pass under its gather (needed.traffic)."""
        order = self.tokens(n * world, world, causal)
        return traffic(mask_in_force(self.mask, causal), order, rank, world, self.gather)


def runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive positions."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(positions.tolist()):
        if out and out[-1][1] + out[-1][2] == p:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, p, 1))
    return out


def gather_plan(layout: str, causal: bool, rank: int, world: int, n: int) -> list[Block]:
    """Blocks of this rank's n queries against the gathered keys (rank-major: rank s's shard
    at rows [s n, (s + 1) n)). Runs of both are aligned to one chunk grid, so a key run is
    wholly before a query run (seen), the same positions (causal diagonal) or after (unseen);
    adjacent seen runs merge into one block."""
    seq = n * world
    if not causal:
        return [Block(0, n, 0, seq)]
    keys = [
        (s * n + a, p, m)
        for s in range(world)
        for a, p, m in runs(layout_positions(seq, layout, s, world))
    ]
    blocks: list[Block] = []
    for qa, qp, qm in runs(layout_positions(seq, layout, rank, world)):
        seen: list[Block] = []
        for ka, kp, km in keys:
            if kp + km <= qp:
                if seen and seen[-1].k1 == ka and not seen[-1].causal:
                    seen[-1] = Block(qa, qa + qm, seen[-1].k0, ka + km)
                else:
                    seen.append(Block(qa, qa + qm, ka, ka + km))
            elif kp == qp:
                seen.append(Block(qa, qa + qm, ka, ka + km, causal=True))
        blocks += seen
    return blocks


def _chunked(blocks: list[Block], n: int, keys: int, p: int) -> list[Block]:
    """The blocks cut into query chunks of p rows (bounds a call's temporaries on CPU)."""
    return [
        part
        for blk in blocks
        for r0 in range(0, n, p)
        for part in restrict(blk, r0, r0 + p, 0, keys)
    ]


def _gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's x (B, n, H, D) as (B, W n, H, D), rank-major (a view when B = 1)."""
    parts = all_gather(x, group)
    return parts.transpose(0, 1).reshape(x.shape[0], -1, *x.shape[2:])


def _kv(
    k: torch.Tensor, v: torch.Tensor, needed: NeededPlan | None, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered K and V: every shard's (needed None), or the rows `needed` names."""
    if needed is None:
        return _gathered(k, group), _gathered(v, group)
    return gather_needed(k, v, needed, group)


def _forward(q, k, v, blocks, group, scale, needed):  # type: ignore[no-untyped-def]
    with clock.step("forward", 0):
        kt, vt = _kv(k, v, needed, group)
        p = piece_size(q.shape[1], q.device)
        parts = _chunked(blocks, q.shape[1], kt.shape[1], p)
        out, lse = empty_result(q)
        step_forward(q, kt, vt, parts, out, lse, scale, False, bounded=True)
    return out, lse


def _backward(dout, q, k, v, out, lse, blocks, group, scale, needed):  # type: ignore[no-untyped-def]
    with clock.step("backward", 0):
        kt, vt = _kv(k, v, needed, group)
        bsz, n = q.shape[:2]
        p = piece_size(n, q.device, _row_bytes(k))
        dq = torch.zeros(q.shape, dtype=primitive.accumulator_dtype(q.dtype), device=q.device)
        dkv = torch.zeros((2, *kt.shape), dtype=dq.dtype, device=q.device)
        chunked = _chunked(blocks, n, kt.shape[1], p)
        step_backward((dout, q, out, lse), (kt, vt), chunked, dq, dkv, scale)
        del kt, vt
        if needed is not None:
            dk, dv = return_grads(dkv, needed, n, group)
            return dq, dk, dv
        world = dkv.shape[2] // n
        dk, dv = (
            reduce_scatter(g.view(bsz, world, n, *k.shape[2:]).transpose(0, 1), group)
            for g in (dkv[0], dkv[1])
        )
    return dq, dk, dv


class AllGatherKV(ShardedKernel):
    """Exact attention on this rank's shard against all-gathered K and V."""

    world_size: int | None = None
    """The ranks `memory_model` assumes (a prediction made before any process group exists
    sets it: workers.model_memory); None: the process group's."""
    causal: bool = False
    """The causality `memory_model` assumes (a caller that knows it sets it): causal blocks
    span fewer keys than the whole length, so their dK/dV buffers are smaller."""

    def __init__(self, params: AllGatherParams | None = None) -> None:
        super().__init__(params or AllGatherParams())

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """merged_memory's saved tensors on this rank's shard of `seq_len` tokens (q, k, v,
        out and lse), plus what grows with the whole length S = W x seq_len: the gathered K
        and V (2 S rows in the input dtype; a reshaped copy of them when batch > 1) in the
        forward and again in the backward, where the shard's fp32 dq, the fp32 dK/dV of all S
        rows and one block's dk, dv (fp32, as many rows as the largest block of any rank spans:
        S when not causal, its plan's when `causal` or masked) are held too before the
        reduce-scatter (dk, dv come after the gathered K/V are freed)."""
        world = self.world_size or rank_and_world(self.params.group)[1]
        total = world * seq_len
        causal = self.causal if self.params.mask is None else parse_mask(self.params.mask).causal
        if self.params.gather == "needed":  # the most rows any rank gathers
            total = max(
                seq_len + self.params.kv_traffic(causal, r, world, seq_len).received
                for r in range(world)
            )
        p = piece_size(seq_len, torch.device("cpu"))
        base = merged_memory(
            batch, seq_len, num_heads, head_dim, dtype_bytes, natural=True, chunk_tokens=p
        )
        gathered = 2 * qkv_bytes(batch, total, num_heads, head_dim, dtype_bytes)
        gathered *= 2 if batch > 1 else 1
        keys = max(
            (
                blk.k1 - blk.k0
                for rank in range(world)
                for blk in self.params.blocks(causal, rank, world, seq_len)
            ),
            default=0,
        )
        grads = 2 * qkv_bytes(batch, total + keys, num_heads, head_dim, 4)
        return KernelMemory(
            saved=base.saved,
            output_saved=True,
            forward_transient=base.forward_transient + gathered,
            backward_transient=qkv_bytes(batch, seq_len, num_heads, head_dim, 4) + gathered + grads,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_causal(self.params.mask, causal)
        group, rank, world = self.join(q, k, v, causal)
        check_allgather(self.params, seq_len=q.shape[1] * world, world_size=world, causal=causal)
        self.backend = primitive.backend_for(q.device, q.dtype)
        n = q.shape[1]
        needed, blocks = self.memo(
            ("plan", causal, rank, world, n), lambda: self._plan(causal, rank, world, n)
        )
        scale = q.shape[-1] ** -0.5
        args = (blocks, group, scale, needed)
        return bound_merged_attention(q, k, v, _forward, _backward, *args)

    def _plan(
        self, causal: bool, rank: int, world: int, n: int
    ) -> tuple[NeededPlan | None, list[Block]]:
        """This rank's exchange under `gather: needed` (else None) and its blocks."""
        needed = self.params.needed(causal, rank, world, n)
        return needed, self.params.blocks(causal, rank, world, n, needed)

    def rank_pairs(self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int) -> int:
        """The pairs of this rank's queries against the keys they keep (its blocks)."""
        return num_heads * sum(b.pairs() for b in self.params.blocks(causal, rank, world, seq_len))

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """gather all: every other shard, its rows no query here keeps wasted; gather needed:
        only the rows kept, none wasted (needed.traffic)."""
        rows = self.params.kv_traffic(causal, rank, world, seq_len)
        row = heads.row(heads.kv_heads)
        return rows.received * row, rows.wasted * row

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Global positions of the tokens rank `rank` holds: the mask plan's order, else the
        layout's."""
        order = self.params.order(seq_len, world_size, causal)
        if order is None:
            return super().local_positions(seq_len, rank, world_size, causal=causal)
        n = seq_len // world_size
        return order[rank * n : (rank + 1) * n]


def check_allgather(
    params: AllGatherParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """seq_len splits over the ranks in the layout in force (zigzag's rule when causal is not
    known and no layout is set)."""
    placement = "contiguous" if params.balance is not None else params.layout  # order checks
    check_seq_len(
        seq_len, default_layout(placement, True if causal is None else causal), world_size
    )
    check_fits(params.mask, seq_len)
    params.order(seq_len, world_size, causal)  # a balance's own rules


register(
    sharded_spec(
        "allgather_kv",
        "Llama-3 context parallelism: every rank all-gathers K and V and computes its own "
        "queries (contiguous or zigzag); the backward reduce-scatters dK and dV. K/V memory "
        "per rank grows with the whole length.",
        AllGatherParams,
        AllGatherKV,
        check_allgather,
        twin="dense",
        comm_overlap=CommOverlap.BLOCKING,
        masks=ALL_MASKS,
        balances=ALL_BALANCES,
    )
)
