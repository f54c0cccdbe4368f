"""`{kind: sliding_window, window: w, causal: bool}`: query q keeps the keys with |q - k| < w,
and only k <= q when causal.

So a causal window of w keeps w keys including the query's own: flash-attn's
`window_size=(w - 1, 0)`; without causal it keeps up to 2w - 1 keys, `window_size=(w - 1, w - 1)`.
A window of 1 keeps only the query's own key; a window >= seq_len keeps what causal (or full)
keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attention.mask.base import Mask


@dataclass(frozen=True)
class SlidingWindow(Mask):
    window: int
    is_causal: bool
    kind = "sliding_window"

    @property
    def causal(self) -> bool:
        return self.is_causal

    @property
    def flash_window(self) -> tuple[int, int]:
        """flash-attn's window_size (left, right) for this mask."""
        return (self.window - 1, 0 if self.is_causal else self.window - 1)

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        near = (q_idx - k_idx).abs() < self.window
        return near & (k_idx <= q_idx) if self.is_causal else near

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = (q_idx - self.window + 1).clamp(min=0)
        hi = q_idx + 1 if self.is_causal else (q_idx + self.window).clamp(max=seq_len)
        return lo, hi

    def check(self, seq_len: int) -> None:
        return None

    def pairs(self, seq_len: int) -> int:
        return window_pairs(seq_len, self.window, self.is_causal)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "causal": self.is_causal, "window": self.window}


def window_pairs(n: int, window: int, causal: bool) -> int:
    """Pairs a window keeps in n tokens, in closed form: with w = min(window, n), every query
    keeps w keys (causal) or 2w - 1 (both sides), less the w (w - 1) / 2 that the start of the
    sequence cuts off (and as many at its end, both sides)."""
    w = min(window, n)
    return n * w - w * (w - 1) // 2 if causal else n * (2 * w - 1) - w * (w - 1)
