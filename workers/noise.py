"""How far a median time can be trusted, and when a timed loop has run enough iterations.

Distribution-free, so that a few slow outliers (a CPU shared with other processes) neither
break the interval nor need a model of the noise:

- the confidence interval of a median is the order-statistic interval [x_(l), x_(n+1-l)]: the
  number of samples below the true median is Binomial(n, 1/2), so the interval covers it with
  probability 1 - 2 P(B <= l - 1); the narrowest one covering at CONFIDENCE is taken. It
  exists from 6 samples on (5 samples: [min, max] covers 93.75% only);
- `iterations: auto` repeats a timed iteration until that interval lies within
  +-AUTO_TOLERANCE of the median (torch.utils.benchmark's adaptive_autorange stops on the
  interquartile range over the median; the median's own interval is the quantity a ratio
  needs), or until the time cap, or AUTO_MAX_ITERATIONS;
- a ratio a / b of two medians lies within [a_lo / b_hi, a_hi / b_lo] when both lie in their
  intervals: `ratio_interval`.

Pure Python; `Iterations` (the loop's decision, agreed by every rank) imports torch lazily.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # rank process only (the service reads intervals)

CONFIDENCE = 0.95
"""The coverage of a median's interval."""
AUTO_TOLERANCE = 0.03
"""`iterations: auto` stops once the median's interval is within +-3% of the median."""
AUTO_MIN_ITERATIONS = 6
"""The fewest samples whose order-statistic interval covers the median at 95% (96.9% at 6)."""
AUTO_MAX_ITERATIONS = 200
"""`iterations: auto` never runs more than this many timed iterations: each is stored (times,
and a ring's steps), and at 200 the interval already spans only the 43rd-57th percentile."""
AUTO_TIME_CAP_S = 2.0
"""The default wall-clock cap of an `iterations: auto` loop (RunConfig.time_cap_s)."""
EXACT_UP_TO = 1000
"""Sample counts up to this get the exact binomial interval; larger ones the normal
approximation of its rank (l = n/2 - z sqrt(n)/2), off by at most one rank there."""


@dataclass(frozen=True)
class Interval:
    """[lo, hi] holding a quantity with probability `level` (1.0: exact bounds)."""

    lo: float
    hi: float
    level: float

    def holds(self, x: float) -> bool:
        """Whether x lies inside (a ratio's interval holding 1.0: within the noise)."""
        return self.lo <= x <= self.hi


def _binomial_rank(n: int, confidence: float) -> tuple[int, float]:
    """(l, coverage) of the largest l >= 1 whose [x_(l), x_(n+1-l)] covers the median of n
    samples with probability >= confidence; l = 1 with its (lower) coverage when none does."""
    total = 1 << n
    miss = Fraction(1) - Fraction(confidence).limit_denominator(10**6)
    below, term, best = 0, 1, 1  # P(B <= l - 1) * 2^n, C(n, l - 1), l
    for lo in range(1, (n + 1) // 2 + 1):
        below += term  # now P(B <= lo - 1) * 2^n
        if 2 * below > miss * total:
            break
        best = lo
        term = term * (n - lo + 1) // lo
    below = sum(math.comb(n, i) for i in range(best))
    return best, float(1 - Fraction(2 * below, total))


@lru_cache(maxsize=4096)
def median_rank(n: int, confidence: float = CONFIDENCE) -> tuple[int, float]:
    """(l, coverage): the median of n samples lies in [x_(l), x_(n+1-l)] (1-based order
    statistics) with probability `coverage` >= confidence; below 6 samples (at 95%) no
    interval reaches it and l = 1 ([min, max]) comes with its lower coverage."""
    if n < 1:
        raise ValueError(f"no samples: n = {n}")
    if n <= EXACT_UP_TO:
        return _binomial_rank(n, confidence)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    lo = max(1, math.floor(n / 2 - z * math.sqrt(n) / 2))
    half = statistics.NormalDist(n / 2, math.sqrt(n) / 2)
    return lo, 1 - 2 * half.cdf(lo - 0.5)


def median_interval(times: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """The order-statistic interval of the median of `times` (see median_rank); its `level`
    says what it covers (below CONFIDENCE with fewer than 6 samples); None for one sample,
    which has no spread at all."""
    n = len(times)
    if n < 2:
        return None
    ordered = sorted(times)
    lo, level = median_rank(n, confidence)
    return Interval(ordered[lo - 1], ordered[n - lo], level)


def settled(
    times: Sequence[float], tolerance: float = AUTO_TOLERANCE, confidence: float = CONFIDENCE
) -> bool:
    """Whether the median of `times` is known to +-tolerance: its interval at `confidence`
    exists (6 samples at 95%) and lies within median x (1 +- tolerance)."""
    found = median_interval(times, confidence)
    if found is None or found.level < confidence:
        return False
    median = statistics.median(times)
    return found.lo >= median * (1 - tolerance) and found.hi <= median * (1 + tolerance)


def auto_vote(times: Sequence[float], elapsed_s: float, cap_s: float) -> tuple[bool, bool]:
    """One rank's (wants_more, capped) after its timed iterations `times`, `elapsed_s` into
    the loop: it wants more until `settled`; it is capped at AUTO_MAX_ITERATIONS, or at the
    time cap once it has AUTO_MIN_ITERATIONS. The loop goes on while some rank wants more and
    none is capped (Iterations)."""
    n = len(times)
    wants_more = not settled(times)
    capped = n >= AUTO_MAX_ITERATIONS or (elapsed_s >= cap_s and n >= AUTO_MIN_ITERATIONS)
    return wants_more, capped


def ratio_interval(a: Interval | None, b: Interval | None) -> Interval | None:
    """The interval of a / b when a and b lie in theirs: [a.lo / b.hi, a.hi / b.lo]; its
    level is at least a.level + b.level - 1 (both hold; 0 when that is negative). None when
    either side has no interval or b may be 0."""
    if a is None or b is None or b.lo <= 0:
        return None
    return Interval(a.lo / b.hi, a.hi / b.lo, max(0.0, a.level + b.level - 1))


def scaled(x: Interval | None, factor: float) -> Interval | None:
    """x times a positive exact factor (tokens / time, a world-size ratio)."""
    if x is None:
        return None
    lo, hi = sorted((x.lo * factor, x.hi * factor))
    return Interval(lo, hi, x.level)


def inverse(x: Interval | None, numerator: float = 1.0) -> Interval | None:
    """numerator / x for x > 0 (tokens/s from a time): [numerator / hi, numerator / lo]."""
    if x is None or x.lo <= 0:
        return None
    return Interval(numerator / x.hi, numerator / x.lo, x.level)


class Iterations:
    """A timed loop's count: `iterations` exactly when it is an int, else `auto` (auto_vote),
    the ranks of a W > 1 run agreeing after every iteration by one all_reduce (MAX of each
    rank's (wants_more, capped)), so every rank runs the same count and its barriers pair up.
    """

    def __init__(
        self,
        iterations: int | str,
        time_cap_s: float | None,
        world_size: int,
        device: torch.device,
    ) -> None:
        if iterations != "auto" and not isinstance(iterations, int):
            raise ValueError(f"iterations must be an int or 'auto', got {iterations!r}")
        if isinstance(iterations, int) and time_cap_s is not None:
            raise ValueError("time_cap_s bounds iterations: auto only")
        self.fixed = iterations if isinstance(iterations, int) else None
        self.cap_s = AUTO_TIME_CAP_S if time_cap_s is None else time_cap_s
        self.world = world_size
        self.device = device
        self.started = time.perf_counter()

    def start(self) -> None:
        """The loop begins now (the time cap counts from here)."""
        self.started = time.perf_counter()

    def more(self, times: Sequence[float]) -> bool:
        """Whether another timed iteration runs after `times` (a collective under auto at
        W > 1 once AUTO_MIN_ITERATIONS have run: every rank calls it after each iteration)."""
        if self.fixed is not None:
            return len(times) < self.fixed
        if len(times) < AUTO_MIN_ITERATIONS:
            return True
        wants_more, capped = auto_vote(times, time.perf_counter() - self.started, self.cap_s)
        if self.world > 1:
            # torch only for the ranks' vote: the read model imports this module for its intervals
            import torch  # rank process only (the service reads intervals)
            import torch.distributed as dist  # rank process only (the service reads intervals)

            from attention.ring.comm import wait_all  # rank process only

            votes = torch.tensor([int(wants_more), int(capped)], device=self.device)
            # async + wait_all: inside a ring abort scope a peer's abort ends the wait
            wait_all([dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True)])
            wants_more, capped = bool(votes[0]), bool(votes[1])
        return wants_more and not capped
