"""Maximum sequence length search: double from `start` to the first OOM, then close the bracket.

A model cell with a memory budget starts from its predicted maximum instead and grows or
shrinks by BRACKET_FACTOR until one length fits and the next does not. The bracket then
narrows to `granularity`: with a memory budget, towards where the measured peaks predict the
budget is met (workers.bracket), else by halving.

Every probed length is one the kernel accepts at the run's world size (attention.validate);
every probe is returned with its outcome, peak memory and time; the answer is the largest
length that fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from workers import kernels, model_memory
from workers.bracket import next_length
from workers.config import RunConfig
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
    probes = [] if probes is None else probes
    best: RunOutcome | None = None
    lo: int | None = None
    hi: int | None = None

    def probe(length: int) -> bool:
        nonlocal best
        at = config.model_copy(update={"seq_len": length})
        cases = run_probe(at, not probes)
        result = probe_of(length, cases)
        probes.append(result)
        if result.outcome == "error":
            raise _ProbeError(result.error or "probe failed")
        if result.outcome == "fit":
            best = outcome_of(cases, config.world_size)
            return True
        return False

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
        if probe(length):
            lo = length
            while True:  # growing by `factor` until a length does not fit
                bound = min(max(int(length * factor), length + 1), search.max)
                nxt = snap_down(config, bound, floor=length + 1, anchors=(length,))
                while nxt is None and bound < search.max:  # none that close: the next one
                    bound = min(2 * bound, search.max)
                    nxt = snap_down(config, bound, floor=length + 1, anchors=(length,))
                if nxt is None:
                    break
                if not probe(nxt):
                    hi = nxt
                    break
                lo = length = nxt
        else:
            hi = length
            while predicted is not None:  # from a prediction: shrinking until one fits
                nxt = snap_down(config, int(length / factor), anchors=(length,))
                if nxt is None or nxt >= length:
                    break
                length = nxt
                if probe(length):
                    lo = length
                    break
                hi = length
        guesses = 0
        while lo is not None and hi is not None and hi - lo > search.granularity:
            # The valid length nearest the predicted one; else nearest the middle; else the
            # largest one below hi. None of them means no accepted length lies between lo
            # and hi: lo is exact.
            target, guessed = next_length(
                lo, hi, _measured_peaks(probes), config.memory_budget_bytes,
                search.granularity, guesses,
            )  # fmt: skip
            mid = snap_down(config, target, floor=lo + 1, anchors=(lo, hi))
            if mid is None and guessed:  # no accepted length that close above lo: halve
                guessed = False
                mid = snap_down(config, (lo + hi) // 2, floor=lo + 1, anchors=(lo, hi))
            guesses += guessed
            if mid is None:
                mid = snap_down(config, hi - 1, floor=lo + 1, anchors=(lo, hi))
            if mid is None:
                break
            if probe(mid):
                lo = mid
            else:
                hi = mid
    except _ProbeError as exc:
        return RunOutcome(status="failed", error=f"probe failed: {exc}", probes=probes)
    if lo is None or best is None:
        return RunOutcome(
            status="oom",
            error=f"even the first length {probes[0].seq_len} did not fit: {probes[0].error}",
            probes=probes,
        )
    return best.model_copy(update={"probes": probes, "answer_seq_len": lo})


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
