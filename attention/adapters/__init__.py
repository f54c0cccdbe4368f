"""Outside attention implementations behind ringlab's protocol and correctness gate.

Each adapter is a module whose `kernel_specs()` an entry point of ringlab's own package names
(pyproject.toml, group `ringlab.kernels`), so it loads like any plugin: one whose package is
missing is listed as unavailable with the ImportError, never skipped. See docs/plugins.md.
What several adapters share lives here; a plugin may use it too (docs/kernels.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn import functional as F

from attention import documents
from attention.base import Kernel, attention_flops
from attention.errors import ParamError
from attention.layouts import check_seq_len, positions
from attention.registry import KernelSpec

P = TypeVar("P")
"""An adapter's params dataclass."""


def check_choice(field: str, value: object, choices: Collection[str]) -> None:
    """ParamError at `field` unless `value` is one of `choices` (a param naming one option)."""
    if value not in choices:
        raise ParamError(field, f"expected one of {', '.join(choices)}, got {value!r}")


def sdpa_bshd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention on (batch, seq, heads, head_dim) tensors, the order
    ringlab's kernels take (SDPA's own is (batch, heads, seq, head_dim)); k and v may have fewer
    heads than q (grouped-query attention, SDPA's enable_gqa)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def require_cuda_half(name: str, q: torch.Tensor) -> None:
    """ValueError unless q is fp16/bf16 on CUDA (what FlashAttention kernels take)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name} runs fp16/bf16 on CUDA only, got {q.dtype} on {q.device.type}")


class RingAdapter(Kernel):
    """An outside ring: this rank holds its shard in `layout`, and computes its share of the
    sequence's pairs (inside `document_lengths` when packed)."""

    layout: str = "contiguous"
    document_lengths: tuple[int, ...] | None = None

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        return positions(seq_len, self.layout, rank, world_size)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """This rank's share of the pairs: every rank computes its queries against the keys
        they may see (causal: half of them on average)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        pairs = documents.pairs(self.document_lengths or (seq_len * world,), causal) // world
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)


def split_check(
    layout: Callable[[P, bool | None], str],
    lengths: Callable[[P], tuple[int, ...] | None] = lambda params: None,
) -> Callable[..., None]:
    """A ring adapter's KernelSpec.check: seq_len must split over world_size ranks in the layout
    `layout(params, causal)` names (causal None: not known yet), and the documents
    `lengths(params)` packs (None: the sequence is one document) must fill it."""

    def check(
        params: P,
        *,
        seq_len: int,
        world_size: int = 1,
        num_heads: int = 1,
        causal: bool | None = None,
    ) -> None:
        documents.check_total(lengths(params), seq_len)
        check_seq_len(seq_len, layout(params, causal), world_size)

    return check


def adapter_specs(
    name: str, description: str, params: type, factory: type[Kernel], **facts: Any
) -> list[KernelSpec]:
    """What an adapter's entry point returns: its one KernelSpec, distributed when the kernel is
    a RingAdapter (it holds one shard per rank); `facts`: the other fields it declares."""
    distributed = issubclass(factory, RingAdapter)
    return [KernelSpec(name, description, params, factory, distributed=distributed, **facts)]
