"""`{kind: causal}`: query q keeps the keys k <= q."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.mask.base import FieldlessMask


@dataclass(frozen=True)
class Causal(FieldlessMask):
    kind = "causal"
    is_causal = True

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        return k_idx <= q_idx

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q_idx), q_idx + 1

    def pairs(self, seq_len: int) -> int:
        return seq_len * (seq_len + 1) // 2
