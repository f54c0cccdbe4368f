"""`{kind: documents, causal: bool, lengths: [...], window: w}`: packed documents with a sliding
window inside each: query q keeps key k of its own document with |q - k| < w (and k <= q when
causal), as attention.mask.sliding_window defines the window."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attention.mask.documents import Documents
from attention.mask.sliding_window import window_pairs


@dataclass(frozen=True)
class DocumentsWindow(Documents):
    window: int = field(kw_only=True)

    @property
    def flash_window(self) -> tuple[int, int]:
        """flash-attn's window_size (left, right) inside each document."""
        return (self.window - 1, 0 if self.is_causal else self.window - 1)

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        return super().keep(q_idx, k_idx) & ((q_idx - k_idx).abs() < self.window)

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = super().bounds(q_idx, seq_len)
        lo = torch.maximum(lo, q_idx - self.window + 1)
        return lo, torch.minimum(hi, q_idx + self.window)

    def pairs(self, seq_len: int) -> int:
        self.check(seq_len)
        return sum(window_pairs(n, self.window, self.is_causal) for n in self.lengths)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        sampled = out.pop("sampled", None)
        out["window"] = self.window
        if sampled is not None:
            out["sampled"] = sampled
        return out
