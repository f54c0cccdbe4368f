"""Hilbert-curve ordering of a square token grid, used by `ordering="hilbert"` kernels.

A sequence of S = 4^k tokens is read row-major as a 2^k x 2^k grid (image patches); the
permutation lists the tokens in Hilbert-curve order, so tokens close on the grid stay close in
the sequence and local or dilated patterns follow 2-D neighbourhoods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from attention.errors import ParamError

ORDERINGS = ("natural", "hilbert")


def is_power_of_four(n: int) -> bool:
    """True for 1, 4, 16, 64, ... (the lengths that form a square grid of side 2^k)."""
    return n > 0 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def check_hilbert_length(seq_len: int) -> None:
    """Raise ValueError unless `seq_len` is a power of 4, the rule for `ordering="hilbert"`."""
    if not is_power_of_four(seq_len):
        raise ParamError(
            "seq_len",
            f"{seq_len} must be a power of 4 (a 2^k x 2^k token grid) for ordering 'hilbert'",
        )


def _d2xy(side: int, d: int) -> tuple[int, int]:
    """Grid cell (x, y) of distance `d` along the Hilbert curve of a side x side grid."""
    x = y = 0
    s = 1
    t = d
    while s < side:
        rx = 1 & (t // 2)
        ry = 1 & (t ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x += s * rx
        y += s * ry
        t //= 4
        s *= 2
    return x, y


@functools.cache
def _hilbert_cpu(seq_len: int) -> torch.Tensor:
    check_hilbert_length(seq_len)
    side = 1 << ((seq_len.bit_length() - 1) // 2)
    order = []
    for d in range(seq_len):
        x, y = _d2xy(side, d)
        order.append(y * side + x)
    return torch.tensor(order, dtype=torch.long)


def hilbert_permutation(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """perm (S,) with perm[i] = row-major index of the token at position i of the Hilbert curve.

    `x[:, perm]` reorders a (batch, seq, ...) tensor into Hilbert order; raises ValueError
    unless seq_len is a power of 4.
    """
    return _hilbert_cpu(seq_len).to(device)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i, so `x[:, perm][:, inv]` is x again."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def check_ordering(ordering: str) -> None:
    """Raise ValueError unless `ordering` is one of ORDERINGS."""
    if ordering not in ORDERINGS:
        valid = ", ".join(ORDERINGS)
        raise ParamError("params.ordering", f"must be one of {valid}, got {ordering!r}")


def in_order(
    ordering: str,
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """fn(q, k, v) on the tokens in `ordering`: under "hilbert" the inputs are permuted into
    Hilbert order and the output permuted back; "natural" calls fn as is."""
    if ordering != "hilbert":
        return fn(q, k, v)
    perm = hilbert_permutation(q.shape[1], q.device)
    out = fn(q[:, perm], k[:, perm], v[:, perm])
    return out[:, inverse_permutation(perm)]
