"""block_sparse's parameters and block mask: the patterns, their fields and checks, the mask a
rank computes with and the closed-form pair counts a submit-time check uses instead."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from attention.errors import ParamError
from attention.hilbert import check_hilbert_length, check_ordering
from attention.plans import check_plan

PATTERNS = ("local_window", "dilated", "global_local", "random")
_PATTERN_FIELDS = {
    "local_window": ("window",),
    "dilated": ("window", "dilation"),
    "global_local": ("window", "num_global"),
    "random": ("num_random", "seed"),
}
_SIZE_FIELD = {"local_window": "window", "dilated": "window", "global_local": "window"}
_SIZE_FIELD["random"] = "num_random"
_OPTIONAL_FIELDS = ("window", "dilation", "num_global", "num_random", "seed")
DEFAULT_SIZE = 1
"""The pattern's size parameter (window, or num_random for random) when neither it nor
sparsity_ratio is given: one block each side (one random block), valid at every length, so
`attention.build("block_sparse")` runs as is."""


def _check_int(field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ParamError(f"params.{field}", f"expected an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class BlockSparseParams:
    """block_size, pattern, and sparsity_ratio or the pattern's own parameters; token ordering.

    Fields a pattern does not use must stay unset (None): setting them is an error. With
    neither sparsity_ratio nor the pattern's size parameter, the size is DEFAULT_SIZE.
    """

    block_size: int = 64
    pattern: str = "local_window"
    sparsity_ratio: float | None = None
    window: int | None = None
    dilation: int | None = None
    num_global: int | None = None
    num_random: int | None = None
    seed: int | None = None
    ordering: str = "natural"
    plan: str = "auto"
    """Execution plan: "cpu" (many small calls tuned to the CPU flash op), "cuda" (one
    FlexAttention call each way under a cached BlockMask) or "auto" (by the inputs' device
    type)."""

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.pattern not in PATTERNS:
            raise ParamError(
                "params.pattern", f"must be one of {', '.join(PATTERNS)}, got {self.pattern!r}"
            )
        used = _PATTERN_FIELDS[self.pattern]
        for field in _OPTIONAL_FIELDS:
            value = getattr(self, field)
            if value is None:
                continue
            if field not in used:
                raise ParamError(
                    f"params.{field}",
                    f"not used by pattern {self.pattern!r} (it uses "
                    f"{', '.join(used)} and sparsity_ratio)",
                )
            _check_int(field, value, 1 if field == "dilation" else 0)
        size = _SIZE_FIELD[self.pattern]
        if self.sparsity_ratio is not None:
            ratio = self.sparsity_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
                raise ParamError("params.sparsity_ratio", f"must be in (0, 1], got {ratio!r}")
            if getattr(self, size) is not None:
                raise ParamError(
                    f"params.{size}",
                    f"conflicts with params.sparsity_ratio; pattern "
                    f"{self.pattern!r} takes one of them",
                )
        elif getattr(self, size) is None:  # neither given: the default size (frozen: set here)
            object.__setattr__(self, size, DEFAULT_SIZE)
        check_ordering(self.ordering)
        check_plan(self.plan)


def _pattern_mask(params: BlockSparseParams, n: int, size: int) -> torch.Tensor:
    """Block keep-mask (n, n) of the pattern with size parameter `size` (window or num_random).

    Built on a rank at run time only; submit-time checks count its pairs in closed form
    (`_kept_pairs`). A window or dilation beyond n blocks means the same as n (all blocks
    within reach), so both are clamped before they meet int64 tensors."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    dist = (i - j).abs()
    size = min(size, n)
    if params.pattern == "local_window":
        return dist <= size
    if params.pattern == "dilated":
        d = min(params.dilation if params.dilation is not None else 2, n)
        return (dist % d == 0) & (dist <= size * d)
    if params.pattern == "global_local":
        g = min(params.num_global if params.num_global is not None else 1, n)
        return (dist <= size) | (i < g) | (j < g)
    # random: the diagonal ranks first, then a seeded random order of the other blocks
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    score = torch.rand(n, n, generator=gen)
    score.fill_diagonal_(2.0)
    top = score.topk(min(n, size + 1), dim=-1).indices
    return torch.zeros(n, n, dtype=torch.bool).scatter_(1, top, True)


def _band_pairs(m: int, reach: int, step: int = 1) -> int:
    """Pairs (i, j) of an m x m grid with |i - j| a multiple of `step` and at most
    reach x step: the diagonal plus two bands per kept offset k x step (m - k x step each)."""
    if m <= 0:
        return 0
    k = min(reach, (m - 1) // step)
    return m * (2 * k + 1) - step * k * (k + 1)


def _kept_pairs(params: BlockSparseParams, n: int, size: int) -> int:
    """The number of True entries of `_pattern_mask(params, n, size)`, from the pattern's
    formula in O(1) (Python ints: any n, any size), so a check never builds the mask."""
    if params.pattern == "local_window":
        return _band_pairs(n, size)
    if params.pattern == "dilated":
        return _band_pairs(n, size, params.dilation if params.dilation is not None else 2)
    if params.pattern == "global_local":
        g = min(n, params.num_global if params.num_global is not None else 1)
        return g * n + (n - g) * g + _band_pairs(n - g, size)
    return n * min(n, size + 1)  # random: the diagonal and `size` others per row


def _density(params: BlockSparseParams, n: int, size: int) -> Fraction:
    """The mask's exact density (kept pairs / n^2)."""
    return Fraction(_kept_pairs(params, n, size), n * n)


def _size_for_ratio(params: BlockSparseParams, n: int, ratio: float) -> int:
    """The size parameter whose mask density is nearest to `ratio` (ties: the smaller),
    by bisection over the closed-form density (exact rationals, O(log n) steps)."""
    if params.pattern == "random":
        return max(0, min(n, math.floor(ratio * n + 0.5)) - 1)
    target = Fraction(ratio)
    lo, hi = 0, n  # densities grow with the window; find the first window reaching the ratio
    while lo < hi:
        mid = (lo + hi) // 2
        if _density(params, n, mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    if lo > 0 and abs(_density(params, n, lo - 1) - target) <= abs(
        _density(params, n, lo) - target
    ):
        return lo - 1
    return lo


def _pattern_size(params: BlockSparseParams, seq_len: int) -> int:
    """The pattern's size parameter at `seq_len`: the given one, or the one nearest to
    sparsity_ratio, which must lie within one block per row (1/n) of it (else ParamError)."""
    n = -(-seq_len // params.block_size)
    if params.sparsity_ratio is None:
        return int(getattr(params, _SIZE_FIELD[params.pattern]))
    size = _size_for_ratio(params, n, params.sparsity_ratio)
    got = _density(params, n, size)
    if abs(got - Fraction(params.sparsity_ratio)) > Fraction(1, n) + Fraction(1, 10**9):
        raise ParamError(
            "params.sparsity_ratio",
            f"pattern {params.pattern!r} cannot reach density "
            f"{params.sparsity_ratio} within one block per row at seq_len {seq_len} "
            f"({n} blocks); nearest is {float(got):.4f}",
        )
    return size


@functools.lru_cache(maxsize=64)
def _cached_block_mask(params: BlockSparseParams, seq_len: int) -> torch.Tensor:
    """The (n, n) mask a rank computes with (run time only: O(n^2) memory)."""
    n = -(-seq_len // params.block_size)
    return _pattern_mask(params, n, _pattern_size(params, seq_len))


def block_sparse_periods(params: BlockSparseParams) -> tuple[int, ...]:
    """The gate's token periods: the block, and a window pattern's span in tokens when the
    pattern gives its size (with sparsity_ratio the window follows the length, so only the
    run's own length shows it: the gate's sampled check)."""
    periods = [params.block_size]
    size = getattr(params, _SIZE_FIELD[params.pattern])
    if size is not None and params.pattern != "random":
        dilation = params.dilation if params.dilation is not None else 1
        periods.append(params.block_size * (size * dilation + 1))
    if params.num_global:
        periods.append(params.block_size * params.num_global)
    return tuple(periods)


def check_block_sparse(
    params: BlockSparseParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Raise ValueError unless seq_len is a power of 4 under hilbert and the sparsity_ratio is
    reachable at that length (any length otherwise: the last block may be shorter)."""
    if params.ordering == "hilbert":
        check_hilbert_length(seq_len)
    _pattern_size(params, seq_len)  # closed form: a submit never builds the (n, n) mask
