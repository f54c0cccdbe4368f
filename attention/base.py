"""What every kernel shares: the call signature, input checks, FLOP and memory accounting."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from attention.errors import ParamError
from attention.primitive import windows

T = TypeVar("T")

BACKWARD_FLOP_FACTOR = 2.5
"""Backward FLOPs per forward FLOP (FlashAttention convention: fwd+bwd = 3.5x forward)."""


def attention_flops(pairs: int, head_dim: int, *, backward: bool = False) -> int:
    """FLOPs of attention over `pairs` (query, key) dot products summed over batch and heads.

    Forward is 4·pairs·d (QK^T and PV, a multiply-add each); backward adds 2.5x that.
    """
    fwd = 4 * pairs * head_dim
    return int(fwd * (1 + BACKWARD_FLOP_FACTOR)) if backward else fwd


def causal_pairs(seq_len: int) -> int:
    """Query-key pairs a causal mask keeps in a square of `seq_len` tokens."""
    return seq_len * (seq_len + 1) // 2


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are (batch, seq, heads, head_dim) tensors that match; k and
    v may have fewer heads than q when they divide q's (grouped-query attention)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v: expected 4-D (batch, seq, heads, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]:
        raise ValueError(
            "q, k, v: shapes must match (k and v may have fewer heads than q), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ParamError(
            "num_kv_heads", f"{k.shape[2]} key/value heads must divide the {q.shape[2]} query heads"
        )
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v: dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v: expected a floating dtype, got {q.dtype}")


@dataclass(frozen=True)
class KernelMemory:
    """Bytes one training call of a kernel holds, from its shapes alone (memory_model()).

    saved: what autograd keeps from the forward to the backward, the q, k, v it saves included;
    output_saved: whether the returned output is one of those saved tensors (else a caller that
    saves the output for its own backward adds it); forward_transient / backward_transient: the
    largest extra bytes the call allocates and frees within its forward / its backward (the
    backward's includes the returned dq, dk, dv).
    """

    saved: int
    output_saved: bool
    forward_transient: int
    backward_transient: int
    inputs_saved: bool = True
    """Whether `saved` counts the q, k, v passed in (a caller that holds them anyway, as a
    benchmark's leaves, holds them once); False when it counts copies of them only (ulysses,
    usp: their head-layout copies after the all-to-all)."""


def qkv_bytes(batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one (batch, seq_len, num_heads, head_dim) tensor."""
    return batch * seq_len * num_heads * head_dim * dtype_bytes


def merged_memory(
    batch: int,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    dtype_bytes: int,
    *,
    natural: bool,
    chunk_tokens: int,
    window_unit: int = 1,
) -> KernelMemory:
    """The memory of a kernel that merges primitive calls into fp32 (out, lse) (dilated,
    block_sparse): it saves q, k, v (hilbert order: their permuted copies and the two int64
    index vectors), the output in the input dtype and the fp32 lse (attention.autograd). The
    returned output is the saved one in natural order; under hilbert, its un-permuted copy.
    The forward's transient is one primitive call's block output (`chunk_tokens` rows: fp32,
    plus the fused op's own in the input dtype when it is narrower) and, for inputs narrower
    than fp32, the fp32 rows of its largest accumulator window (primitive.windows, in
    `window_unit` tokens: block_sparse's block size). The backward's transient is the fp32 dq,
    dk, dv accumulators plus, when the input dtype is not fp32, one copy in it (MergedFunction
    casts them one at a time, each accumulator freed once cast). This is the cpu plan's; the
    cuda plans hold less (dilated's sums bf16 gradients in bf16, block_sparse's FlexAttention
    keeps no accumulator), so on CUDA the model is an upper bound (bench.plan counts them)."""
    one = qkv_bytes(batch, seq_len, num_heads, head_dim, dtype_bytes)
    fp32 = qkv_bytes(batch, seq_len, num_heads, head_dim, 4)
    lse = 4 * batch * num_heads * seq_len
    index = 0 if natural else 2 * 8 * seq_len
    call_rows = min(seq_len, chunk_tokens) * num_heads * head_dim  # one batch row a call
    block = call_rows * 4
    if dtype_bytes < 4:
        spans = windows(seq_len, torch.bfloat16, window_unit)
        window = max((c1 - c0 for c0, c1 in spans), default=0)
        block += call_rows * dtype_bytes + qkv_bytes(batch, window, num_heads, head_dim, 4)
    return KernelMemory(
        saved=4 * one + lse + index,
        output_saved=natural,
        forward_transient=block,
        backward_transient=3 * fp32 + (0 if dtype_bytes == 4 else one),
    )


class Kernel(nn.Module):
    """Base of every kernel: `module(q, k, v, *, causal=False) -> out` with q's shape and dtype.

    `backend` names the primitive backend the last call ran (for results to record);
    `flops(...)` counts only the query-key pairs the kernel actually computes.
    """

    backend: str | None = None
    plan: str | None = None
    """The execution plan the last call ran ("cpu" or "cuda"), for the kernels that choose one
    by the inputs' device under `plan: auto` (dilated, block_sparse, ring_dilated, and ulysses
    over one of them); None for the others. Results record it beside `backend`."""

    def __init__(self, params: Any = None) -> None:
        """`params`: the kernel's parameters (its KernelSpec's dataclass), kept as self.params:
        a spec's factory may be the class itself."""
        super().__init__()
        self.params = params

    def memo(self, key: Hashable, build: Callable[[], T]) -> T:
        """build(), once per `key` for this module (its params are frozen): a mask's plan walks
        every tile in Python, host time each call would otherwise spend again."""
        built: dict[Hashable, Any] = self.__dict__.setdefault("_built", {})
        if key not in built:
            built[key] = build()
        return built[key]

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """FLOPs of one call on (batch, seq_len, num_heads, head_dim) inputs of this rank."""
        raise NotImplementedError

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """What one training call on this rank's (batch, seq_len, heads, head_dim) inputs of
        `dtype_bytes` per element keeps for backward and allocates on the way (KernelMemory).

        A kernel without a model raises NotImplementedError; a prediction then says so."""
        raise NotImplementedError(f"{type(self).__name__} has no memory model")


class ExactKernel(Kernel):
    """A kernel that computes every query-key pair (the lower triangle when causal): its FLOPs
    are dense attention's (adapters and plugins of exact attention build on it)."""

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        pairs = causal_pairs(seq_len) if causal else seq_len * seq_len
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)


class MergedKernel(Kernel):
    """A kernel that merges primitive calls into (out, lse) accumulators (dilated,
    block_sparse): its memory is `merged_memory`'s, with its params' token ordering and the
    tokens of one primitive call (`chunk_tokens`) and the unit of its accumulator windows."""

    chunk_tokens: int = 0
    params: Any

    @property
    def window_unit(self) -> int:
        """Tokens its accumulator windows come in multiples of (primitive.windows)."""
        return 1

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """See attention.base.merged_memory (q, k, v, the merged out and lse)."""
        return merged_memory(
            batch,
            seq_len,
            num_heads,
            head_dim,
            dtype_bytes,
            natural=self.params.ordering != "hilbert",
            chunk_tokens=self.chunk_tokens,
            window_unit=self.window_unit,
        )
