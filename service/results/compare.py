"""The compare page's logic on the one read model (service.results.rows rows): matching cells of two
sweeps, their B/A ratios and a verdict that respects the measured noise.

A time changed only when the two runs' median intervals (service.results.rows: the slowest rank's
order-statistic interval, at the level its iteration count gives) do not overlap, so the B/A
tokens/s interval (both spreads: b_lo / a_hi .. b_hi / a_lo) excludes 1.0, and only when both
intervals reach CONFIDENCE (95%: 6 iterations or more). Below that (2-5 iterations: the range of
all samples, 50%-94%; one iteration: no interval) two ranges miss each other too often by chance
to call a change: such a cell is "too few iterations to tell", never slower nor faster. Two
sweeps whose specs are identical but for their names ran the same cells: a difference between
them comes from the code or the machine, not from the experiment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.results.rows import RunRow
from service.spec import canonical_json
from workers.noise import CONFIDENCE, ratio_interval

MEMORY_TOLERANCE = 0.10
"""Peak memory and maximum length have no repeats to give a spread: a change counts beyond this."""


def unmatched(a_rows: Sequence[RunRow], b_rows: Sequence[RunRow]) -> tuple[int, int]:
    """How many cells are only in A, and only in B (no run with the same config in the other)."""
    a_keys = {r.cell_key for r in a_rows}
    b_keys = {r.cell_key for r in b_rows}
    return len(a_keys - b_keys), len(b_keys - a_keys)


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


SPEC_NAME_FIELDS = ("name",)
"""What two specs may differ in and still be the same experiment."""


def same_spec(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two sweeps' specs are identical once their names are dropped."""
    if a is None or b is None:
        return False

    def kept(spec: dict[str, Any]) -> str:
        return canonical_json({k: v for k, v in spec.items() if k not in SPEC_NAME_FIELDS})

    return kept(a) == kept(b)


TOO_FEW = "too few iterations to tell"
"""The verdict on a time when a run's interval is missing or covers less than CONFIDENCE."""


def too_few(row: RunRow) -> bool:
    """Whether a measured run's median interval cannot tell a change: none (one iteration) or
    below CONFIDENCE (2-5 iterations)."""
    interval = row.time_interval
    return row.median_s is not None and (interval is None or interval.level < CONFIDENCE)


def time_verdict(a: RunRow, b: RunRow) -> str | None:
    """'slower', 'faster', 'within noise' or TOO_FEW for a time measured in both runs (None
    when one has no time): the stated level is CONFIDENCE, never less."""
    if a.median_s is None or b.median_s is None:
        return None
    if too_few(a) or too_few(b):
        return TOO_FEW
    return time_change(a, b) or "within noise"


def time_change(a: RunRow, b: RunRow) -> str | None:
    """'slower' or 'faster' when B's median interval lies wholly above or below A's, both at
    CONFIDENCE or more, else None (they overlap: within the noise; or a run's interval is
    missing or below CONFIDENCE: too few iterations to tell)."""
    ia, ib = a.time_interval, b.time_interval
    if ia is None or ib is None or min(ia.level, ib.level) < CONFIDENCE:
        return None
    if ib.lo > ia.hi:
        return "slower"
    if ib.hi < ia.lo:
        return "faster"
    return None


def compare_rows(a_rows: Sequence[RunRow], b_rows: Sequence[RunRow]) -> list[dict[str, Any]]:
    """Pairs of runs with the same config in sweeps A and B, with B/A ratios and a verdict.

    Regression: B slower beyond both spreads at CONFIDENCE (time_change), B's peak memory
    above A's or its maximum length below A's by more than MEMORY_TOLERANCE, or A succeeded
    and B did not.
    """
    b_by_key = {r.cell_key: r for r in b_rows}
    tol = MEMORY_TOLERANCE
    pairs = []
    for a in a_rows:
        b = b_by_key.get(a.cell_key)
        if b is None:
            continue
        tps = _ratio(b.tokens_per_s, a.tokens_per_s)
        tps_spread = ratio_interval(b.tokens_per_s_interval, a.tokens_per_s_interval)
        mem = _ratio(b.peak_memory_bytes, a.peak_memory_bytes)
        maxlen = _ratio(b.max_seq_len, a.max_seq_len)
        change = time_change(a, b)
        reasons = []
        if a.status == "succeeded" and b.status != "succeeded":
            reasons.append(f"B {b.status}")
        if change == "slower":
            reasons.append("slower")
        if mem is not None and mem > 1 + tol:
            reasons.append("more memory")
        if maxlen is not None and maxlen < 1 - tol:
            reasons.append("shorter max length")
        pairs.append(
            {
                "label": f"{a.label} · seq {a.length:,}",
                "a": a,
                "b": b,
                "time_ratio": _ratio(b.median_s, a.median_s),
                "tps_ratio": tps,
                "tps_lo": None if tps_spread is None else tps_spread.lo,
                "tps_hi": None if tps_spread is None else tps_spread.hi,
                "within_noise": tps_spread is not None and tps_spread.holds(1.0),
                "time_change": change,
                "time_verdict": time_verdict(a, b),
                "memory_ratio": mem,
                "max_len_ratio": maxlen,
                "regression": bool(reasons),
                "reasons": reasons,
            }
        )
    return pairs


def compare_out(a_id: int, b_id: int, a_rows: Sequence[RunRow], b_rows: Sequence[RunRow],
                same: bool) -> dict[str, Any]:  # fmt: skip
    """The comparison as plain JSON values (GET /api/v1/sweeps/{a}/compare/{b})."""
    pairs = compare_rows(a_rows, b_rows)
    only_a, only_b = unmatched(a_rows, b_rows)
    keep = ("label", "tps_ratio", "tps_lo", "tps_hi", "within_noise", "time_change",
            "time_verdict", "memory_ratio", "max_len_ratio", "regression", "reasons",
            "time_ratio")  # fmt: skip
    values = ("status", "median_s", "tokens_per_s", "peak_memory_bytes", "max_seq_len",
              "iterations", "median_ci_level")  # fmt: skip
    return {
        "a": a_id,
        "b": b_id,
        "same_spec": same,
        "only_a": only_a,
        "only_b": only_b,
        "regressions": sum(p["regression"] for p in pairs),
        "within_noise": sum(p["within_noise"] for p in pairs),
        "too_few": sum(p["time_verdict"] == TOO_FEW for p in pairs),
        "pairs": [
            {
                "a_run_id": p["a"].run_id,
                "b_run_id": p["b"].run_id,
                **{k: p[k] for k in keep},
                **{f"a_{v}": getattr(p["a"], v) for v in values},
                **{f"b_{v}": getattr(p["b"], v) for v in values},
            }
            for p in pairs
        ],
    }
