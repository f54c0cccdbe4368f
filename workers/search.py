"""Maximum sequence length search: double from `start` to the first OOM, then close the bracket.

A model cell with a memory budget starts from its predicted maximum instead and grows or
shrinks by BRACKET_FACTOR until one length fits and the next does not. The bracket then
narrows to `granularity`: with a memory budget, towards where the measured peaks predict the
budget is met (workers.bracket), else by halving.

Every probed length is one the kernel accepts at the run's world size (attention.validate);
every probe is returned with its outcome, peak memory and time; the answer is the largest
length that fit.

A compiled kernel (attention.compiled) compiles a graph per length, so at every probe: its
warm-up (workers.protocol._prime) runs once at the probe's own length and mode even under
`warmup: 0`, the search's usual setting, so the probe's peak and time never hold the
compilation; the probe's run records it apart (compile_s, compilations).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from workers import kernels, model_memory
from workers.bracket import next_length
from workers.config import RunConfig, SearchConfig
from workers.results import CaseOutcome, ProbeResult, RunOutcome, outcome_of

# Steps a length is rounded down to until the kernel accepts it (its divisibility rules are
# multiples of segment sizes, block sizes and the world size).
_FACTORS = (1, 3, 5, 7)

ProbeRunner = Callable[[RunConfig, bool], list[CaseOutcome]]
BRACKET_FACTOR = 1.125
"""A search from a predicted maximum grows (or shrinks) by this factor until it brackets it."""


def predicted_start(config: RunConfig) -> int | None:
    """Where a model cell's search starts: its predicted maximum length under its memory
    budget (workers.model_memory), rounded down to a length the kernel accepts; None when
    there is no budget or no prediction (the search then doubles from search.start)."""
    if config.workload != "model" or config.memory_budget_bytes is None:
        return None
    try:
        longest = model_memory.max_seq_len(config, config.memory_budget_bytes)
    except NotImplementedError:
        return None  # the kernel has no memory model; its runs say so
    return None if longest is None else snap_down(config, longest)


def _divisors(n: int) -> list[int]:
    """Every positive divisor of n (n >= 1), by trial division up to sqrt(n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def snap_down(
    config: RunConfig, length: int, floor: int = 1, anchors: tuple[int, ...] = ()
) -> int | None:
    """The largest length in [floor, length] the kernel accepts, among the candidate multiples.

    Candidates are `length` rounded down to f * 2**k (f in 1, 3, 5, 7) and to every divisor of
    gcd(anchors), where anchors are lengths known to be valid. A kernel whose valid lengths are
    the multiples of some quantum q (a block size, lcm of segment lengths, the world size) has q
    dividing every valid anchor, so with an anchor the answer is exact whatever q is (a block
    size of 100 included).
    """
    steps = {factor << power for power in range(63) if 1 << power <= length for factor in _FACTORS}
    valid_anchors = [a for a in anchors if a >= 1]
    if valid_anchors:
        steps.update(_divisors(math.gcd(*valid_anchors)))
    candidates = sorted({length - length % step for step in steps if step <= length}, reverse=True)
    for candidate in candidates:
        if candidate < floor:
            break
        if kernels.is_valid_length(config, candidate):
            return candidate
    return None


def probe_of(seq_len: int, cases: list[CaseOutcome]) -> ProbeResult:
    """One probe from its ranks' cases: error beats oom beats fit; peak and time are the worst."""
    ordered = sorted(cases, key=lambda c: c.rank)
    peaks = [c.peak_memory_bytes for c in cases if c.peak_memory_bytes is not None]
    requested = [c.requested_bytes for c in cases if c.requested_bytes is not None]
    inputs = [
        c.result.input_memory_bytes
        for c in cases
        if c.result is not None and c.result.input_memory_bytes is not None
    ]
    times = [c.result.median_s for c in cases if c.result is not None]
    failed = [c for c in cases if c.status == "failed"]
    ooms = [c for c in cases if c.status == "oom"]
    bad = failed or ooms
    return ProbeResult(
        seq_len=seq_len,
        outcome="error" if failed else "oom" if ooms else "fit",
        peak_memory_bytes=max(peaks) if peaks else None,
        input_memory_bytes=max(inputs) if inputs else None,
        rank_peak_bytes=[c.peak_memory_bytes for c in ordered],
        requested_bytes=max(requested) if requested else None,
        time_s=max(times) if times else None,
        error="; ".join(f"rank {c.rank}: {c.error}" for c in bad) or None,
        emulated=bool(ooms) and not failed and all(c.emulated for c in ooms),
    )


def _measured_peaks(probes: list[ProbeResult]) -> dict[int, int]:
    """Peak bytes by length of the probes whose peak is the whole probe's: fits and emulated
    OOMs. A real OOM's peak (where some ranks report one) is only the ranks that fit."""
    return {
        p.seq_len: p.peak_memory_bytes
        for p in probes
        if p.peak_memory_bytes and (p.outcome == "fit" or p.emulated)
    }


class _ProbeError(Exception):
    """A probe ended with an error that is not an OOM: the search cannot go on."""


def _grown(config: RunConfig, length: int, factor: float, maximum: int) -> int | None:
    """The next accepted length above `length` (which fit) near `length * factor`; when none
    is that close, near twice the bound, and so on up to `maximum`; None when none is left."""
    bound = min(max(int(length * factor), length + 1), maximum)
    nxt = snap_down(config, bound, floor=length + 1, anchors=(length,))
    while nxt is None and bound < maximum:  # none that close: the next one
        bound = min(2 * bound, maximum)
        nxt = snap_down(config, bound, floor=length + 1, anchors=(length,))
    return nxt


def _between(
    config: RunConfig, lo: int, hi: int, target: int, guessed: bool
) -> tuple[int | None, bool]:
    """(the accepted length in (lo, hi) to probe next, whether it is a prediction).

    The valid length nearest `target` (the predicted one, else the middle); when a predicted
    target has none that close above lo, the one nearest the middle; else the largest one
    below hi. None means no accepted length lies between lo and hi: lo is exact.
    """
    mid = snap_down(config, target, floor=lo + 1, anchors=(lo, hi))
    if mid is None and guessed:  # no accepted length that close above lo: halve
        guessed = False
        mid = snap_down(config, (lo + hi) // 2, floor=lo + 1, anchors=(lo, hi))
    if mid is None:
        mid = snap_down(config, hi - 1, floor=lo + 1, anchors=(lo, hi))
    return mid, guessed


class _Search:
    """One search's state: every probe so far, the bracket (lo fit, hi did not) and the
    outcome of the best fit."""

    def __init__(
        self,
        config: RunConfig,
        search: SearchConfig,
        run_probe: ProbeRunner,
        probes: list[ProbeResult],
    ) -> None:
        self.config = config
        self.search = search
        self.run_probe = run_probe
        self.probes = probes
        self.best: RunOutcome | None = None
        self.lo: int | None = None
        self.hi: int | None = None

    def probe(self, length: int) -> bool:
        """Run one probe at `length` and record it; whether it fit (_ProbeError on an error)."""
        at = self.config.model_copy(update={"seq_len": length})
        cases = self.run_probe(at, not self.probes)
        result = probe_of(length, cases)
        self.probes.append(result)
        if result.outcome == "error":
            raise _ProbeError(result.error or "probe failed")
        if result.outcome == "fit":
            self.best = outcome_of(cases, self.config.world_size)
            return True
        return False

    def grow(self, length: int, factor: float) -> None:
        """From `length`, which fit: grow by `factor` until a length does not fit."""
        self.lo = length
        while True:
            nxt = _grown(self.config, length, factor, self.search.max)
            if nxt is None:
                return
            if not self.probe(nxt):
                self.hi = nxt
                return
            self.lo = length = nxt

    def shrink(self, length: int, factor: float) -> None:
        """From a predicted `length`, which did not fit: shrink by `factor` until one fits."""
        while True:
            nxt = snap_down(self.config, int(length / factor), anchors=(length,))
            if nxt is None or nxt >= length:
                return
            length = nxt
            if self.probe(length):
                self.lo = length
                return
            self.hi = length

    def narrow(self) -> None:
        """Close the bracket to search.granularity: towards the length the measured peaks
        predict meets the memory budget (workers.bracket), else by halving."""
        guesses = 0
        while self.lo is not None and self.hi is not None:
            lo, hi = self.lo, self.hi
            if hi - lo <= self.search.granularity:
                return
            target, guessed = next_length(
                lo, hi, _measured_peaks(self.probes), self.config.memory_budget_bytes,
                self.search.granularity, guesses,
            )  # fmt: skip
            mid, guessed = _between(self.config, lo, hi, target, guessed)
            guesses += guessed
            if mid is None:
                return
            if self.probe(mid):
                self.lo = mid
            else:
                self.hi = mid

    def outcome(self) -> RunOutcome:
        """succeeded with the largest length that fit, or oom when even the first did not."""
        if self.lo is None or self.best is None:
            first = self.probes[0]
            return RunOutcome(
                status="oom",
                error=f"even the first length {first.seq_len} did not fit: {first.error}",
                probes=self.probes,
            )
        return self.best.model_copy(update={"probes": self.probes, "answer_seq_len": self.lo})


def run_search(
    config: RunConfig, run_probe: ProbeRunner, probes: list[ProbeResult] | None = None
) -> RunOutcome:
    """Drive the search with `run_probe(config_at_length, first)`; the outcome holds every probe.

    `probes`, when given, receives each probe as it ends: the caller still has them when the
    search never returns (a timeout, a cancel, a lost rank) and stores them with that outcome.

    succeeded: the answer is the largest length that fit (and `ranks` hold its measurement);
    oom: even the first length did not fit; failed: a probe ended with an error.
    """
    search = config.search
    if search is None:
        raise ValueError("search: a max_seq_len run needs a search config")
    state = _Search(config, search, run_probe, [] if probes is None else probes)
    predicted = predicted_start(config)
    first = search.start if predicted is None else predicted
    factor = 2.0 if predicted is None else BRACKET_FACTOR
    length = snap_down(config, min(first, search.max))
    if length is None:
        raise ValueError(
            f"search.start: no length <= {first} fits kernel {config.kernel!r} at "
            f"world_size {config.world_size}"
        )
    try:
        if state.probe(length):
            state.grow(length, factor)
        else:
            state.hi = length
            if predicted is not None:  # from a prediction: shrinking until one fits
                state.shrink(length, factor)
        state.narrow()
    except _ProbeError as exc:
        return RunOutcome(status="failed", error=f"probe failed: {exc}", probes=state.probes)
    return state.outcome()
