"""What every mask gives: the token predicate, each query's kept key range, the block map and
the kept-pair count.

Every mask here keeps, for each query q, one contiguous range of keys [lo(q), hi(q)) (full,
causal, sliding windows, documents, prefix-LM and their combinations all do). The predicate
`keep` is written from the mask's definition; the block map and the pair counts are computed
from the ranges, one query row at a time in chunks, so no (S, S) tensor is ever built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

_CHUNK_ELEMENTS = 1 << 22
"""Query rows x key blocks handled at once by `Mask.blocks` (32 MiB of int64)."""


@dataclass(frozen=True)
class BlockMap:
    """Kept pairs of every (query block, key block) tile of an (S, S) mask cut in blocks of
    `block_size` tokens; the last block is short when block_size does not divide seq_len."""

    seq_len: int
    block_size: int
    pairs: torch.Tensor
    """(n, n) int64: kept pairs of the tile (query block i, key block j)."""

    @property
    def sizes(self) -> torch.Tensor:
        """(n,) tokens in each block."""
        starts = torch.arange(0, self.seq_len, self.block_size)
        return (starts + self.block_size).clamp(max=self.seq_len) - starts

    @property
    def kept(self) -> torch.Tensor:
        """(n, n) bool: the tile keeps at least one pair (it must be computed)."""
        return self.pairs > 0

    @property
    def full(self) -> torch.Tensor:
        """(n, n) bool: the tile keeps every pair (computed without a mask)."""
        sizes = self.sizes
        return self.pairs == sizes[:, None] * sizes[None, :]

    @property
    def partial(self) -> torch.Tensor:
        """(n, n) bool: kept but not full (computed under the token predicate)."""
        return self.kept & ~self.full


class Mask(ABC):
    """One attention mask, as data. Subclasses are frozen dataclasses, one per file."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def causal(self) -> bool:
        """No query keeps a key after itself."""

    @abstractmethod
    def keep(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """The token predicate: query q_idx keeps key k_idx (long tensors, broadcast)."""

    @abstractmethod
    def bounds(self, q_idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[lo, hi): the keys each query in q_idx keeps, in a sequence of seq_len tokens."""

    @abstractmethod
    def check(self, seq_len: int) -> None:
        """ParamError (naming the mask's field) unless the mask fits seq_len tokens."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The mask as a run's `mask` takes it (parse(m.to_dict()) == m)."""

    def dense(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """keep (S, S), for references and tests."""
        idx = torch.arange(seq_len, device=device)
        return self.keep(idx[:, None], idx[None, :])

    def rows(self, rows: torch.Tensor, seq_len: int) -> torch.Tensor:
        """keep (len(rows), S): the rows at query positions `rows` (a shard's queries)."""
        keys = torch.arange(seq_len, device=rows.device)
        return self.keep(rows.long()[:, None], keys[None, :])

    def row_pairs(self, seq_len: int) -> torch.Tensor:
        """(S,) int64: keys each query keeps."""
        lo, hi = self.bounds(torch.arange(seq_len), seq_len)
        return (hi - lo).clamp(min=0)

    def pairs(self, seq_len: int) -> int:
        """Kept (query, key) pairs of the whole mask (kinds override it with a closed form;
        the tests hold each to the sum of row_pairs and to brute force)."""
        return int(self.row_pairs(seq_len).sum())

    def blocks(self, seq_len: int, block_size: int) -> BlockMap:
        """The block map at `block_size`, exact, in O(S x S / block_size) time, chunked."""
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        n = -(-seq_len // block_size)
        starts = torch.arange(n) * block_size
        ends = (starts + block_size).clamp(max=seq_len)
        pairs = torch.zeros(n, n, dtype=torch.int64)
        step = max(1, _CHUNK_ELEMENTS // n)
        for r0 in range(0, seq_len, step):
            q = torch.arange(r0, min(r0 + step, seq_len))
            lo, hi = self.bounds(q, seq_len)
            cnt = torch.minimum(hi[:, None], ends) - torch.maximum(lo[:, None], starts)
            pairs.index_add_(0, q // block_size, cnt.clamp(min=0))
        return BlockMap(seq_len, block_size, pairs)


class FieldlessMask(Mask):
    """A mask without fields (full, causal): its class says whether it is causal, it fits any
    length, and its dict is its kind alone."""

    is_causal: ClassVar[bool]

    @property
    def causal(self) -> bool:
        return self.is_causal

    def check(self, seq_len: int) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}
