"""`{kind: causal}`: query q keeps the keys k <= q."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attention.mask.base import Mask


@dataclass(frozen=True)
class Causal(Mask):
    kind = "causal"

    @property
    def causal(self) -> bool:
        return True

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        return k_idx <= q_idx

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q_idx), q_idx + 1

    def check(self, seq_len: int) -> None:
        return None

    def pairs(self, seq_len: int) -> int:
        return seq_len * (seq_len + 1) // 2

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}
