"""The compare page's logic on the one read model (service.views rows): matching cells of two
sweeps, their B/A ratios and a verdict that respects the measured spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.views import RunRow

MEMORY_TOLERANCE = 0.10
"""Peak memory and maximum length have no repeats to give a spread: a change counts beyond this."""


def unmatched(a_rows: Sequence[RunRow], b_rows: Sequence[RunRow]) -> tuple[int, int]:
    """How many cells are only in A, and only in B (no run with the same config in the other)."""
    a_keys = {r.cell_key for r in a_rows}
    b_keys = {r.cell_key for r in b_rows}
    return len(a_keys - b_keys), len(b_keys - a_keys)


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def time_change(a: RunRow, b: RunRow) -> str | None:
    """'slower' or 'faster' when B's p10-p90 time lies wholly above or below A's, else None
    (the two spreads overlap: the difference is within the noise)."""
    if None in (a.p10_s, a.p90_s, b.p10_s, b.p90_s):
        return None
    assert a.p10_s is not None and a.p90_s is not None  # for mypy: checked just above
    assert b.p10_s is not None and b.p90_s is not None
    if b.p10_s > a.p90_s:
        return "slower"
    if b.p90_s < a.p10_s:
        return "faster"
    return None


def compare_rows(a_rows: Sequence[RunRow], b_rows: Sequence[RunRow]) -> list[dict[str, Any]]:
    """Pairs of runs with the same config in sweeps A and B, with B/A ratios and a verdict.

    Regression: B slower outside both spreads, B's peak memory above A's or its maximum length
    below A's by more than MEMORY_TOLERANCE, or A succeeded and B did not.
    """
    b_by_key = {r.cell_key: r for r in b_rows}
    tol = MEMORY_TOLERANCE
    pairs = []
    for a in a_rows:
        b = b_by_key.get(a.cell_key)
        if b is None:
            continue
        tps = _ratio(b.tokens_per_s, a.tokens_per_s)
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
                "tps_ratio": tps,
                "time_change": change,
                "memory_ratio": mem,
                "max_len_ratio": maxlen,
                "regression": bool(reasons),
                "reasons": reasons,
            }
        )
    return pairs
