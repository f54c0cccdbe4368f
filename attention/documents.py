"""Packed variable-length batches: several documents back to back in one sequence, attention
confined to each document (block-diagonal, causal within a document when causal).

`document_lengths` is a parameter of `dense` and `ring` (the kernels that support packing):
the lengths, in order, summing to the sequence length. FLOPs count only the pairs inside
documents; the reference is dense attention under `document_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from attention.base import causal_pairs
from attention.errors import ParamError

MAX_DOCUMENTS = 65_536
"""More documents than this in one sequence are refused (one check per document per step)."""


def normalize(lengths: Any) -> tuple[int, ...] | None:
    """`document_lengths` as a tuple of positive ints (None: one document), else ParamError."""
    if lengths is None:
        return None
    if not isinstance(lengths, list | tuple) or not lengths:
        raise ParamError("params.document_lengths", f"expected a non-empty list, got {lengths!r}")
    if len(lengths) > MAX_DOCUMENTS:
        raise ParamError(
            "params.document_lengths", f"at most {MAX_DOCUMENTS} documents, got {len(lengths)}"
        )
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParamError(
                "params.document_lengths", f"every length must be an integer >= 1, got {n!r}"
            )
    return tuple(lengths)


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
    return sum(causal_pairs(n) if causal else n * n for n in lengths)


def document_mask(
    lengths: Sequence[int], causal: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """keep (S, S): query i attends to key j of its own document (j <= i when causal)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= torch.ones_like(keep).tril()
    return keep.to(device)
