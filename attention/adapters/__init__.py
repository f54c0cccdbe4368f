"""Outside attention implementations behind ringlab's protocol and correctness gate.

Each adapter is a module whose `kernel_specs()` an entry point of ringlab's own package names
(pyproject.toml, group `ringlab.kernels`), so it loads like any plugin: one whose package is
missing is listed as unavailable with the ImportError, never skipped. See docs/plugins.md.
What several adapters share lives here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attention import documents
from attention.base import Kernel, attention_flops
from attention.layouts import positions


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
