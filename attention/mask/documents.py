"""`{kind: documents, causal: bool, lengths: [...]}`: packed documents, back to back in one
sequence; a query keeps the keys of its own document (only k <= q when causal).

The lengths come given (`lengths`), sampled (`sampled`, attention.mask.lengths) or from a file
(`lengths_file`); a run stores them expanded into `lengths`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attention.errors import ParamError
from attention.mask.base import Mask


@dataclass(frozen=True)
class Documents(Mask):
    lengths: tuple[int, ...]
    is_causal: bool
    sampled: dict[str, Any] | None = field(default=None, compare=False, kw_only=True)
    """How the lengths were sampled, when they were (stored beside them, re-checked on parse)."""
    kind = "documents"

    @property
    def causal(self) -> bool:
        return self.is_causal

    def ends(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(D,) end (exclusive) of every document."""
        return torch.tensor(self.lengths, dtype=torch.int64, device=device).cumsum(0)

    def document_of(self, idx: torch.Tensor) -> torch.Tensor:
        """The document index of every token in idx."""
        return torch.searchsorted(self.ends(idx.device), idx, right=True)

    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        same = self.document_of(q_idx) == self.document_of(k_idx)
        return same & (k_idx <= q_idx) if self.is_causal else same

    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ends = self.ends(q_idx.device)
        starts = ends - torch.tensor(self.lengths, dtype=torch.int64, device=q_idx.device)
        doc = torch.searchsorted(ends, q_idx, right=True)
        return starts[doc], q_idx + 1 if self.is_causal else ends[doc]

    def check(self, seq_len: int) -> None:
        if sum(self.lengths) != seq_len:
            raise ParamError(
                "mask.lengths",
                f"the documents' lengths sum to {sum(self.lengths)}, but seq_len is {seq_len}",
            )

    def pairs(self, seq_len: int) -> int:
        self.check(seq_len)
        return sum(n * (n + 1) // 2 if self.is_causal else n * n for n in self.lengths)

    def summary(self) -> dict[str, float]:
        """count, mean and max of the document lengths (what a report shows)."""
        n = len(self.lengths)
        return {"count": n, "mean": sum(self.lengths) / n, "max": max(self.lengths)}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "causal": self.is_causal,
            "lengths": list(self.lengths),
        }
        if self.sampled is not None:
            out["sampled"] = dict(self.sampled)
        return out
