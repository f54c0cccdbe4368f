"""Packed variable-length batches: several documents back to back in one sequence, attention
confined to each document (block-diagonal, causal within a document when causal): the older
spelling of the `documents` mask (attention.mask.documents; attention.mask.from_legacy).

`document_lengths` is a parameter of `dense` and `ring` (the kernels that support packing):
the lengths, in order, summing to the sequence length. FLOPs count only the pairs inside
documents; the reference is dense attention under `document_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from attention.errors import ParamError
from attention.mask import Documents
from attention.mask.lengths import MAX_DOCUMENTS, check_lengths

__all__ = ["MAX_DOCUMENTS", "bounds", "check_total", "document_mask", "normalize", "pairs"]


def normalize(lengths: Any) -> tuple[int, ...] | None:
    """`document_lengths` as a tuple of positive ints (None: one document), else ParamError."""
    if lengths is None:
        return None
    return check_lengths(lengths, "params.document_lengths")


def check_total(lengths: tuple[int, ...] | None, seq_len: int) -> None:
    """ParamError unless the documents fill the sequence exactly."""
    if lengths is not None and sum(lengths) != seq_len:
        raise ParamError(
            "params.document_lengths",
            f"the documents' lengths sum to {sum(lengths)}, but seq_len is {seq_len}",
        )


def bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of every document."""
    ends = list(accumulate(lengths))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def pairs(lengths: Sequence[int], causal: bool) -> int:
    """Query-key pairs inside the documents."""
    return Documents(tuple(lengths), causal).pairs(sum(lengths))


def document_mask(
    lengths: Sequence[int], causal: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """keep (S, S): query i attends to key j of its own document (j <= i when causal)."""
    return Documents(tuple(lengths), causal).dense(sum(lengths), device)
