"""`offset_window`: sliding-window attention (|i - j| < window) that drops the key exactly
`bug_offset` positions before each query from position `bug_after` on: a kernel wrong only
beyond its first rows, which a gate checking 128 tokens passed. It declares the correct mask
(keep_mask, keep_rows) and its period (the window), so the gate can catch it.
`fail_without_grad` makes it raise under torch.no_grad (the timed forward, not the gate): a
run that fails after its gate passed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from attention import Kernel, KernelSpec, attention_flops


@dataclass(frozen=True)
class OffsetParams:
    """window: keys less than this far away; the bug: the key bug_offset before each query
    at position >= bug_after is dropped (None: no bug); fail_without_grad: raise under
    torch.no_grad."""

    window: int = 256
    bug_offset: int | None = 200
    bug_after: int = 0
    fail_without_grad: bool = False


def keep_rows(params: OffsetParams, seq_len: int, causal: bool, rows: torch.Tensor) -> torch.Tensor:
    """The correct mask's rows: (len(rows), seq_len)."""
    offset = rows[:, None] - torch.arange(seq_len, device=rows.device)[None, :]
    keep = offset.abs() < params.window
    return keep & (offset >= 0) if causal else keep


def keep_mask(
    params: OffsetParams, seq_len: int, causal: bool, device: torch.device
) -> torch.Tensor:
    """The correct mask: (seq_len, seq_len)."""
    return keep_rows(params, seq_len, causal, torch.arange(seq_len, device=device))


class OffsetWindow(Kernel):
    backend = "sdpa"

    def __init__(self, params: OffsetParams) -> None:
        super().__init__()
        self.params = params

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        p, n = self.params, q.shape[1]
        if p.fail_without_grad and not torch.is_grad_enabled():
            raise RuntimeError("offset_window: no inference mode (fail_without_grad)")
        mask = keep_mask(p, n, causal, q.device)
        if p.bug_offset is not None:
            rows = torch.arange(min(p.bug_after, n), n, device=q.device)
            keys = rows - p.bug_offset
            mask[rows[keys >= 0], keys[keys >= 0]] = False  # the bug
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        pairs = int(keep_mask(self.params, seq_len, causal, torch.device("cpu")).sum())
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)


def kernel_specs() -> list[KernelSpec]:
    return [
        KernelSpec(
            name="offset_window",
            description="Sliding-window attention missing one key offset (wrong on purpose).",
            params=OffsetParams,
            factory=OffsetWindow,
            keep_mask=keep_mask,
            keep_rows=keep_rows,
            periods=lambda params: (params.window,),
        )
    ]
