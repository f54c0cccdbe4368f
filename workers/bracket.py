"""Where a maximum-length search probes next, once one length fits and a longer one does not.

A forward's peak memory grows about linearly with the length, so the line through two measured
peaks predicts the length whose peak meets the budget: the bracket's two ends when both were
measured (on CPU an emulated OOM's peak is), else the fitting end and the longest fit below it
(a real OOM measures nothing). The next probe is the fitting end plus as many whole steps of
`granularity` as stay at or below the prediction, at least one. A right prediction closes the
bracket in one or two probes where halving needs log2((hi - lo) / granularity): the dense
search of examples/cpu-max-seq-len-1gpu.yaml went from four probes after the first OOM to one.

Nothing about the answer depends on the prediction: every probe still either fits (the
bracket's low end moves up) or not (the high end moves down), and the search still ends when
the bracket is no wider than the granularity. A prediction outside the bracket, fewer than two
peaks, or MAX_GUESSES predictions already made in one search fall back to the middle, so
memory that is far from linear costs about MAX_GUESSES probes more than bisection (a few more
where rounding to a length the kernel accepts moves the halving points).

Torch-free and config-free: bench/gpu_search.py, which runs where no pydantic is installed,
uses it as workers/search.py does.
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_GUESSES = 3
"""Predicted probes one search makes before it only halves."""


def predicted_length(lo: int, hi: int, peaks: Mapping[int, int], budget: int) -> float | None:
    """The length whose peak meets `budget` on the line through two measured peaks (see the
    module), or None without two distinct ones or with a line that does not rise."""
    if lo not in peaks:
        return None
    if hi in peaks:
        other = hi
    else:
        below = [n for n in peaks if n < lo]
        if not below:
            return None
        other = max(below)
    slope = (peaks[other] - peaks[lo]) / (other - lo)
    if slope <= 0:
        return None
    return lo + (budget - peaks[lo]) / slope


def next_length(
    lo: int,
    hi: int,
    peaks: Mapping[int, int],
    budget: int | None,
    granularity: int,
    guesses: int,
) -> tuple[int, bool]:
    """(the length to probe between lo, which fit, and hi, which did not; whether it is a
    prediction). `peaks`: measured peak bytes by length; `guesses`: predictions made so far.
    The caller rounds the length to one its kernel accepts."""
    if budget is not None and guesses < MAX_GUESSES:
        guess = predicted_length(lo, hi, peaks, budget)
        if guess is not None and lo < guess < hi:
            length = lo + max(1, int((guess - lo) // granularity)) * granularity
            if length < hi:
                return length, True
    return (lo + hi) // 2, False
