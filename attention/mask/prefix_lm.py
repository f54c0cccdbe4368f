"""`{kind: prefix_lm, prefix: p}`: the first p tokens attend to each other both ways, the rest
causally: query q keeps key k when k <= q or k < p. A prefix of 0 is causal; a prefix of
seq_len is full."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attention.errors import ParamError
from attention.mask.base import Mask


@dataclass(frozen=True)
class PrefixLM(Mask):
    prefix: int
    kind = "prefix_lm"

    @property
    def causal(self) -> bool:
        return self.prefix <= 1

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        return (k_idx <= q_idx) | (k_idx < self.prefix)

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q_idx), (q_idx + 1).clamp(min=self.prefix)

    def check(self, seq_len: int) -> None:
        if self.prefix > seq_len:
            raise ParamError("mask.prefix", f"{self.prefix} is longer than seq_len {seq_len}")

    def pairs(self, seq_len: int) -> int:
        self.check(seq_len)
        p = self.prefix
        return p * p + (seq_len * (seq_len + 1) - p * (p + 1)) // 2

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "prefix": self.prefix}
