"""`ulysses`: DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2023).

Each rank holds a contiguous shard of the sequence, all heads. An all-to-all turns it into the
whole sequence for H / W heads; any single-process kernel (`params.inner`: dense, dilated or
block_sparse, with its own params beside `inner`) runs on that; a second all-to-all returns the
output to its tokens. The backward mirrors it (attention.ring.collectives).

Heads: W must divide num_heads. K/V with num_kv_heads < W are replicated to W head groups (as
yunchang and LoongTrain do), which needs num_kv_heads to divide W; otherwise W must divide
num_kv_heads. With dilated inside, LongNet's head groups follow the GLOBAL head index
(segments.global_heads): rank r's heads are heads [r H / W, (r + 1) H / W) of the model.

Memory (memory_model): the inner kernel keeps its head-layout q, k, v and output (one shard's
bytes each) from the forward to the backward, where it also holds the output gradient and its
dq, dk, dv in that layout at once: four to five shards above a ring's (which saves the caller's
q, k, v and returns its saved output). That is what the inner kernel needs when it runs all of
this rank's heads in one call; the collectives add no buffer beyond one all-to-all's send and
receive copies, each freed before the next layout copy.

Step clock: forward step 0 is the all-to-all of q, k, v, step 1 the inner kernel, step 2 the
all-to-all of the output; backward step 0 the output gradient's all-to-all, 1 the inner
kernel's backward, 2 the all-to-all of dq, dk, dv.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from attention.base import KernelMemory, qkv_bytes
from attention.errors import ParamError
from attention.hilbert import hilbert_permutation
from attention.mask.takes import ALL_MASKS, check_causal, kernel_balance, kernel_mask
from attention.registry import (
    KERNELS,
    CommOverlap,
    KernelSpec,
    build,
    cuda_head_dim_problem,
    make_params,
    register,
    structural_periods,
)
from attention.ring import needed
from attention.ring.collectives import heads_of, tokens_of
from attention.ring.comm import rank_and_world
from attention.ring.mask_plan import mask_in_force
from attention.ring.sharded import HeadShape, ShardedKernel, check_group
from attention.ring.steps import clock
from attention.segments import global_heads

NAME = "ulysses"
"""Its registered name: its params read the kernels it may wrap from its KernelSpec (`inner`)."""


@dataclass(frozen=True)
class UlyssesParams:
    """inner: the kernel run on each rank's heads; group: the process group (None: the world);
    every other field is the inner kernel's own parameter (None: its default), and a field the
    inner kernel does not take is an error."""

    inner: str = "dense"
    group: Any = dataclasses.field(default=None, compare=False)
    document_lengths: Any = None
    segment_lengths: Any = None
    dilation_rates: Any = None
    ordering: Any = None
    plan: Any = None
    block_size: Any = None
    pattern: Any = None
    sparsity_ratio: Any = None
    window: Any = None
    dilation: Any = None
    num_global: Any = None
    num_random: Any = None
    seed: Any = None
    mask: Any = None
    balance: Any = None

    def __post_init__(self) -> None:
        kernels = KERNELS[NAME].inner
        if self.inner not in kernels:
            raise ParamError(
                "params.inner", f"must be one of {', '.join(kernels)}, got {self.inner!r}"
            )
        check_group(self.group)
        object.__setattr__(self, "mask", check_inner_mask(self.inner, self.mask))
        kernel_balance(self.balance, "ulysses", frozenset())  # every rank does the same work
        parsed = make_params(self.inner, self.inner_params())
        for name in self.inner_params():  # normalized by the inner kernel (lists -> tuples)
            object.__setattr__(self, name, getattr(parsed, name))

    def inner_params(self) -> dict[str, Any]:
        """The inner kernel's params (the fields set); a field it does not take raises."""
        own = inner_fields(self.inner)
        # a full or causal mask reaches an inner kernel without a `mask` as its causal flag
        mine = ("inner", "group", "balance", *(() if "mask" in own else ("mask",)))
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in mine and getattr(self, f.name) is not None
        }
        for name in given:
            if name not in own:
                raise ParamError(
                    f"params.{name}",
                    f"not a parameter of inner kernel {self.inner!r} (it takes "
                    f"{', '.join(sorted(own)) or 'none'})",
                )
        return given


def check_inner_mask(inner: str, mask: Any) -> dict[str, Any] | None:
    """The mask's dict (kernel_mask); ParamError (`mask`) unless the inner kernel takes its
    kind (KernelSpec.masks)."""
    given = kernel_mask(mask, "ulysses", ALL_MASKS)
    takes = KERNELS[inner].masks
    if given is not None and given["kind"] not in takes:
        raise ParamError(
            "mask",
            f"kernel 'ulysses' runs inner kernel {inner!r}, which takes the masks "
            f"{', '.join(sorted(takes))}, not {given['kind']}",
        )
    return given


def inner_fields(inner: str) -> set[str]:
    """The init fields of an inner kernel's params."""
    return {f.name for f in dataclasses.fields(KERNELS[inner].params) if f.init}


def check_heads(num_heads: int, num_kv_heads: int, degree: int, field: str) -> None:
    """Raise ParamError unless `degree` ranks can split the heads: degree | num_heads, and
    degree | num_kv_heads or (replication) num_kv_heads | degree. `field` names the degree."""
    if num_heads % degree:
        raise ParamError(
            "num_heads",
            f"{num_heads} must be divisible by {field} {degree} (each rank gets H / {field})",
        )
    if num_kv_heads % degree and degree % num_kv_heads:
        raise ParamError(
            "num_kv_heads",
            f"{num_kv_heads} must be divisible by {field} {degree}, or divide it (K/V heads fewer "
            f"than {field} are replicated to {degree} head groups)",
        )


def replicate_kv(x: torch.Tensor, degree: int) -> torch.Tensor:
    """K or V with fewer heads than `degree` repeated to `degree` heads (each kv head serves
    degree / num_kv_heads consecutive ranks); unchanged otherwise. Its gradient sums back."""
    kv = x.shape[2]
    return x if kv >= degree else x.repeat_interleave(degree // kv, dim=2)


class InnerCall(torch.autograd.Function):
    """The inner kernel on (q, k, v) inside a head window and a clock step, forward and
    backward: its backward runs the inner graph under the same window (LongNet's groups) and
    times it as backward step 1."""

    @staticmethod
    def forward(ctx, q, k, v, fn, window):  # type: ignore[no-untyped-def]
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad(), _window(window), clock.step("forward", 1):
            out = fn(*leaves)
        ctx.leaves, ctx.out, ctx.window = leaves, out, window
        return out.detach()

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def]
        with _window(ctx.window), clock.step("backward", 1):
            grads = torch.autograd.grad(ctx.out, ctx.leaves, dout)
        ctx.leaves = ctx.out = None
        return (*grads, None, None)


@contextlib.contextmanager
def _window(window: tuple[int, int] | None) -> Iterator[None]:
    if window is None:
        yield
    else:
        with global_heads(*window):
            yield


def heads_exchange(
    x: torch.Tensor, members: tuple[int, ...], me: int, group: Any, step: int
) -> torch.Tensor:
    """heads_of under forward step `step` (its backward is backward step 2)."""
    with clock.step("forward", step):
        return heads_of(x, members, me, group, 2)


def tokens_exchange(
    y: torch.Tensor, members: tuple[int, ...], me: int, group: Any, step: int
) -> torch.Tensor:
    """tokens_of under forward step `step` (its backward is backward step 0)."""
    with clock.step("forward", step):
        return tokens_of(y, members, me, group, 0)


class UlyssesAttention(ShardedKernel):
    """Exact (inner-kernel) attention on this rank's contiguous shard of every head."""

    world_size: int | None = None
    """The ranks `memory_model` assumes (a prediction made before any process group exists
    sets it: workers.model_memory); None: the process group's."""

    def __init__(self, params: UlyssesParams | None = None) -> None:
        super().__init__(params or UlyssesParams())
        self.inner = build(self.params.inner, **self.params.inner_params())

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """One call on this rank's shard of `seq_len` tokens (W ranks, S = W seq_len): the
        inner kernel's memory on S tokens of H / W heads, whose q, k, v are the all-to-all's
        head-layout copies (one shard's bytes each), held from the forward to the backward
        with the inner output (so `saved` holds copies, not the caller's q, k, v, and the
        returned token-layout output is not saved). Forward transient: the larger of the
        inner's and the output all-to-all's send and receive buffers (two shards). Backward
        transient: the output gradient in head layout (one shard) and the inner backward's,
        while the saved tensors are still held. K/V heads replicated below W are not
        counted (a GQA model with fewer K/V heads than ranks holds up to W / kv more)."""
        world = self.world_size or rank_and_world(self.params.group)[1]
        one = qkv_bytes(batch, seq_len, num_heads, head_dim, dtype_bytes)
        inner = self.inner.memory_model(
            batch, seq_len * world, num_heads // world, head_dim, dtype_bytes
        )
        if world == 1:  # no all-to-all: the inner kernel on the caller's tensors
            return inner
        return KernelMemory(
            saved=inner.saved + (0 if inner.output_saved else one),
            output_saved=False,
            forward_transient=max(inner.forward_transient, 2 * one),
            backward_transient=one + inner.backward_transient,
            inputs_saved=False,
        )

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Global positions of the tokens rank `rank` holds: a contiguous shard."""
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_causal(self.params.mask, causal)
        group, rank, world = self.join(
            q, k, v, causal, lambda world: check_heads(q.shape[2], k.shape[2], world, "world_size")
        )
        members = tuple(range(world))
        heads = q.shape[2]
        k, v = replicate_kv(k, world), replicate_kv(v, world)
        qh, kh, vh = (heads_exchange(t, members, rank, group, 0) for t in (q, k, v))
        window = (rank * heads // world, heads) if self.params.inner == "dilated" else None

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.inner(q, k, v, causal=causal)  # type: ignore[no-any-return]

        if torch.is_grad_enabled() and any(t.requires_grad for t in (qh, kh, vh)):
            out = InnerCall.apply(qh, kh, vh, fn, window)
        else:
            with _window(window), clock.step("forward", 1):
                out = fn(qh, kh, vh)
        self.backend = getattr(self.inner, "backend", None)
        self.plan = getattr(self.inner, "plan", None)
        return tokens_exchange(out, members, rank, group, 2)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """FLOPs of this rank for a local shard of `seq_len` tokens: the inner kernel's on the
        whole sequence for H / W heads (its head groups may differ in cost: LongNet's do not)."""
        _, world = rank_and_world(self.params.group)
        total = self.inner.flops(batch, seq_len * world, num_heads, head_dim, causal, backward)
        return int(total // world)

    def kv_comm_bytes(
        self, seq_len: int, heads: HeadShape, causal: bool, rank: int, world: int
    ) -> tuple[int, int] | None:
        """The all-to-all of k and v: the other W - 1 ranks' shards for this rank's H_kv / W
        key/value heads (at least one: replicate_kv), their rows none of the queries of its
        H / W heads keeps a pair with under the inner kernel's pattern wasted (kept_keys)."""
        kept = self.kept_keys(seq_len * world, heads.num_heads, causal, rank, world)
        mine = kept[rank * seq_len : (rank + 1) * seq_len]
        received = (world - 1) * seq_len
        wasted = received - (int(kept.sum()) - int(mine.sum()))
        row = heads.row(max(heads.kv_heads, world) // world)  # its H_kv / W heads
        return received * row, wasted * row

    def kept_keys(
        self, seq_len: int, num_heads: int, causal: bool, rank: int, world: int
    ) -> torch.Tensor:
        """(S,) bool by global token: the keys at least one query of rank `rank`'s heads keeps
        on the whole sequence of `seq_len` tokens: the inner dense kernel's mask, block_sparse's
        block mask, dilated's offset groups of this rank's global heads (both on the Hilbert
        order's positions under ordering hilbert, mapped back to the tokens)."""
        inner = self.params.inner
        p = self.inner.params
        if inner == "dense":
            mask = mask_in_force(p.mask, causal, p.document_lengths)
            return needed.kept_keys(mask, torch.arange(seq_len), 0, 1)
        if inner == "block_sparse":
            blocks = self.inner.block_mask(seq_len, causal=causal).any(0)
            kept = blocks.repeat_interleave(p.block_size)
        elif inner == "dilated":
            with global_heads(rank * num_heads // world, num_heads):
                kept = needed.offset_kept(p.branches(), seq_len, num_heads // world)
        else:
            raise ValueError(f"no kept keys for inner kernel {inner!r}")
        if p.ordering != "hilbert":
            return kept
        tokens = torch.empty_like(kept)
        tokens[hilbert_permutation(seq_len)] = kept
        return tokens


def check_ulysses(
    params: UlyssesParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """W | num_heads, W | seq_len, and the inner kernel's own rules on the whole sequence."""
    check_heads(num_heads, num_heads, world_size, "world_size")
    if seq_len % world_size:
        raise ParamError("seq_len", f"{seq_len} must be divisible by world_size {world_size}")
    spec = KERNELS[params.inner]
    if spec.check is not None:
        inner = make_params(params.inner, params.inner_params())
        spec.check(inner, seq_len=seq_len, world_size=1, num_heads=num_heads, causal=causal)


def inner_head_dim_problem(params: UlyssesParams, dtype: torch.dtype, head_dim: int) -> str | None:
    """The inner kernel's CUDA head_dim rule: each rank runs it on whole heads."""
    return cuda_head_dim_problem(params.inner, params.inner_params(), dtype, head_dim)


register(
    KernelSpec(
        name=NAME,
        cuda_head_dim=inner_head_dim_problem,
        description=(
            "DeepSpeed-Ulysses: an all-to-all gives each rank the whole sequence for H / W "
            "heads, an inner kernel (dense, dilated, block_sparse) runs on it, a second "
            "all-to-all returns the output."
        ),
        params=UlyssesParams,
        factory=UlyssesAttention,
        distributed=True,
        twin="dense",
        check=check_ulysses,
        comm_overlap=CommOverlap.BLOCKING,
        inner=("dense", "dilated", "block_sparse"),
        masks=ALL_MASKS,
        periods=lambda p: structural_periods(p.inner, p.inner_params()),
        heads_check=lambda p, heads, kv, world: check_heads(heads, kv, world, "world_size"),
        reference_of=lambda params: (
            (p := make_params(NAME, params)).inner,
            p.inner_params(),
        ),
    )
)
