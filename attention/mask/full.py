"""`{kind: full}`: every query keeps every key (bidirectional attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.mask.base import FieldlessMask


@dataclass(frozen=True)
class Full(FieldlessMask):
    kind = "full"
    is_causal = False

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(q_idx, dtype=torch.bool) & torch.ones_like(k_idx, dtype=torch.bool)

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q_idx), torch.full_like(q_idx, seq_len)

    def pairs(self, seq_len: int) -> int:
        return seq_len * seq_len
