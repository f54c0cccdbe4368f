"""`sliding_window`: each query attends to the keys less than `window` positions away (and,
causal, not after it), computed by torch SDPA with a boolean mask.

A complete ringlab kernel plugin (docs/plugins.md): a parameter dataclass that validates
itself, a Kernel with `flops`, the mask the correctness gate builds its reference from (its rows
at given query positions, `keep_rows`, and the whole mask, `keep_mask`), the kernel's structural
period (the window) and `kernel_specs`, the callable the `ringlab.kernels` entry point names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention import Kernel, KernelSpec, ParamError, attention_flops
from attention.adapters import sdpa_bshd


@dataclass(frozen=True)
class SlidingWindowParams:
    """window: how many positions a query sees on each side, itself included (>= 1)."""

    window: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ParamError("params.window", f"must be an integer >= 1, got {self.window!r}")


def keep_rows(
    params: SlidingWindowParams, seq_len: int, causal: bool, rows: torch.Tensor
) -> torch.Tensor:
    """(len(rows), seq_len) bool: the mask's rows at the query positions `rows` (1-D int64, on
    the device the mask is wanted on), built without the (seq_len, seq_len) mask."""
    offset = rows[:, None] - torch.arange(seq_len, device=rows.device)[None, :]
    keep = offset.abs() < params.window
    return keep & (offset >= 0) if causal else keep


def keep_mask(
    params: SlidingWindowParams, seq_len: int, causal: bool, device: torch.device
) -> torch.Tensor:
    """(seq_len, seq_len) bool: True where query i attends to key j (every row of keep_rows)."""
    return keep_rows(params, seq_len, causal, torch.arange(seq_len, device=device))


def window_pairs(n: int, window: int, causal: bool) -> int:
    """Query-key pairs keep_mask keeps, in closed form."""
    w = min(window, n)
    return n * w - w * (w - 1) // 2 if causal else n * (2 * w - 1) - w * (w - 1)


class SlidingWindowAttention(Kernel):
    """`module(q, k, v, *, causal=False)` on (batch, seq, heads, head_dim) tensors."""

    backend = "sdpa"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        mask = keep_mask(self.params, q.shape[1], causal, q.device)
        return sdpa_bshd(q, k, v, attn_mask=mask)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        pairs = batch * num_heads * window_pairs(seq_len, self.params.window, causal)
        return attention_flops(pairs, head_dim, backward=backward)


def kernel_specs() -> list[KernelSpec]:
    """What the `ringlab.kernels` entry point returns: this plugin's kernels."""
    return [
        KernelSpec(
            name="sliding_window",
            description="Sliding-window attention (|i - j| < window) on torch SDPA with a mask.",
            params=SlidingWindowParams,
            factory=SlidingWindowAttention,
            keep_mask=keep_mask,
            keep_rows=keep_rows,
            periods=lambda p: (p.window,),
        )
    ]
