"""Maximum sequence length search: double from `start` to the first OOM, then bisect.

Every probed length is one the kernel accepts at the run's world size (attention.validate);
every probe is returned with its outcome, peak memory and time; the answer is the largest
length that fit.
"""

from __future__ import annotations

from collections.abc import Callable

from workers import kernels
from workers.config import RunConfig
from workers.results import CaseOutcome, ProbeResult, RunOutcome

# Steps a length is rounded down to until the kernel accepts it (its divisibility rules are
# multiples of segment sizes, block sizes and the world size).
_FACTORS = (1, 3, 5, 7)

ProbeRunner = Callable[[RunConfig, bool], list[CaseOutcome]]


def snap_down(config: RunConfig, length: int, floor: int = 1) -> int | None:
    """The largest length <= `length` (and >= floor) the kernel accepts, among round multiples."""
    best: int | None = None
    for power in range(0, 63):
        if 1 << power > length:
            break
        for factor in _FACTORS:
            step = factor << power
            if step > length:
                continue
            candidate = length - length % step
            better = candidate >= floor and (best is None or candidate > best)
            if better and kernels.is_valid_length(config, candidate):
                best = candidate
        if best == length:
            break
    return best


def probe_of(seq_len: int, cases: list[CaseOutcome]) -> ProbeResult:
    """One probe from its ranks' cases: error beats oom beats fit; peak and time are the worst."""
    peaks = [c.peak_memory_bytes for c in cases if c.peak_memory_bytes is not None]
    times = [c.result.median_s for c in cases if c.result is not None]
    failed = [c for c in cases if c.status == "failed"]
    ooms = [c for c in cases if c.status == "oom"]
    bad = failed or ooms
    return ProbeResult(
        seq_len=seq_len,
        outcome="error" if failed else "oom" if ooms else "fit",
        peak_memory_bytes=max(peaks) if peaks else None,
        time_s=max(times) if times else None,
        error="; ".join(f"rank {c.rank}: {c.error}" for c in bad) or None,
        emulated=bool(ooms) and not failed and all(c.emulated for c in ooms),
    )


def run_search(config: RunConfig, run_probe: ProbeRunner) -> RunOutcome:
    """Drive the search with `run_probe(config_at_length, first)`; the outcome holds every probe.

    succeeded: the answer is the largest length that fit (and `ranks` hold its measurement);
    oom: even the first length did not fit; failed: a probe ended with an error.
    """
    from workers.gang import outcome_of

    search = config.search
    if search is None:
        raise ValueError("search: a max_seq_len run needs a search config")
    probes: list[ProbeResult] = []
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

    length = snap_down(config, min(search.start, search.max))
    if length is None:
        raise ValueError(
            f"search.start: no length <= {search.start} fits kernel {config.kernel!r} at "
            f"world_size {config.world_size}"
        )
    try:
        while True:  # doubling
            if not probe(length):
                hi = length
                break
            lo = length
            nxt = snap_down(config, min(2 * length, search.max), floor=length + 1)
            if nxt is None:
                break
            length = nxt
        if lo is not None and hi is not None:  # bisection
            while hi - lo > search.granularity:
                mid = snap_down(config, (lo + hi) // 2, floor=lo + 1)
                if mid is None or mid >= hi:
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


class _ProbeError(Exception):
    """A probe ended with an error that is not an OOM: the search cannot go on."""
