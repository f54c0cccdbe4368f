"""How a (batch, seq, ...) sequence is split over the ranks of a ring: contiguous, zigzag, striped.

- contiguous: rank r holds tokens [r*n, (r+1)*n) with n = seq / W.
- zigzag: the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r (causal balance).
- striped: rank r holds tokens r, r+W, r+2W, ... (Striped Attention, causal balance).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attention.errors import ParamError

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    """Raise ValueError unless `layout` is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ParamError("params.layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def check_seq_len(seq_len: int, layout: str, world_size: int) -> None:
    """Raise ValueError unless `seq_len` tokens split evenly over `world_size` ranks."""
    check_layout(layout)
    if world_size < 1:
        raise ParamError("world_size", f"must be >= 1, got {world_size}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if seq_len % parts:
        what = f"2 x world_size = {parts}" if layout == "zigzag" else f"world_size {world_size}"
        raise ParamError("seq_len", f"{seq_len} must divide by {what} for layout {layout!r}")


def positions(seq_len: int, layout: str, rank: int, world_size: int) -> torch.Tensor:
    """Global positions (long, seq_len / W) of the tokens rank `rank` holds, in its local order."""
    check_seq_len(seq_len, layout, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    n = seq_len // world_size
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size)
    c = n // 2
    last = 2 * world_size - 1 - rank
    first = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([first, torch.arange(last * c, (last + 1) * c)])


def shard(x: torch.Tensor, layout: str, rank: int, world_size: int) -> torch.Tensor:
    """This rank's part (batch, seq / W, ...) of a full (batch, seq, ...) tensor (a copy)."""
    if x.dim() < 2:
        raise ValueError(f"x: expected (batch, seq, ...), got shape {tuple(x.shape)}")
    seq_len = x.shape[1]
    check_seq_len(seq_len, layout, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    n = seq_len // world_size
    if layout == "contiguous":
        return x[:, rank * n : (rank + 1) * n].clone()
    if layout == "striped":
        return x[:, rank::world_size].clone()
    c = n // 2
    last = 2 * world_size - 1 - rank
    return torch.cat([x[:, rank * c : (rank + 1) * c], x[:, last * c : (last + 1) * c]], dim=1)


def unshard(parts: Sequence[torch.Tensor], layout: str) -> torch.Tensor:
    """The full (batch, seq, ...) tensor from every rank's part, given in rank order."""
    check_layout(layout)
    world_size = len(parts)
    if world_size == 0:
        raise ValueError("parts: need at least one rank's part")
    shape = parts[0].shape
    for rank, part in enumerate(parts):
        if part.shape != shape:
            raise ValueError(
                f"parts[{rank}]: shape {tuple(part.shape)} differs from rank 0's {tuple(shape)}"
            )
    if len(shape) < 2:
        raise ValueError(f"parts: expected (batch, seq, ...), got shape {tuple(shape)}")
    n = shape[1]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"parts: zigzag parts hold two equal chunks; local seq {n} is odd")
    full = parts[0].new_empty((shape[0], n * world_size, *shape[2:]))
    for rank, part in enumerate(parts):
        full[:, positions(n * world_size, layout, rank, world_size).to(part.device)] = part
    return full
