"""The regression gate of `ringlab compare A B --fail-on-regression`: which matching cells of
two sweeps moved, on one metric, beyond the noise and a threshold.

It reads GET /api/v1/sweeps/{a}/compare/{b} and adds no rule of its own for the noise: a time
(median_s, tokens_per_s) moved only when the compare endpoint's `time_change` says so (the two
medians' intervals, each at 95% or more, do not overlap: beyond both sweeps' spreads,
service.results.compare), and then only when it moved by more than the threshold too. A cell
whose time moved by more than the threshold while a run's interval covers less than 95% (fewer
than 6 iterations) is neither worse nor better: "too few iterations to tell" (`untold`). Peak
memory and maximum length are one measurement each (no spread): they moved beyond the
threshold alone. A cell that succeeded
in A and did not in B is a regression on every metric: a kernel that stopped working is worse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from service.units import EMPTY, MIB, level, nbytes

METRICS = ("median_s", "tokens_per_s", "peak_memory_bytes", "max_seq_len")
"""What the gate can compare; for the first two higher time is worse, then higher memory,
then a shorter maximum length."""

_THRESHOLD = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%?\s*")


def parse_threshold(text: str) -> float:
    """'5%' (or '5') as the fraction 0.05; a ValueError naming the flag for anything else."""
    match = _THRESHOLD.fullmatch(text)
    if match is None:
        raise ValueError(f"--threshold: a percentage such as 5% is needed, got {text!r}")
    value = float(match.group(1)) / 100
    if value >= 10:
        raise ValueError(f"--threshold: at most 1000%, got {text!r}")
    return value


@dataclass(frozen=True)
class Move:
    """One matching cell whose metric moved: worse (a regression) or better."""

    label: str
    a_run_id: int
    b_run_id: int
    worse: bool
    text: str


def _fmt(metric: str, value: Any) -> str:
    if value is None:
        return EMPTY
    if metric == "median_s":
        return f"{value * 1e3:.3f} ms"
    if metric == "peak_memory_bytes":
        return nbytes(value, units=(MIB,), digits=1)
    if metric == "tokens_per_s":
        return f"{value:,.0f} tok/s"
    return f"{value:,}"


def _ratio(pair: dict[str, Any], metric: str) -> float | None:
    a, b = pair.get(f"a_{metric}"), pair.get(f"b_{metric}")
    return b / a if a and b is not None else None


def _direction(pair: dict[str, Any], metric: str, threshold: float) -> bool | None:
    """True: worse beyond the rule, False: better beyond it, None: not moved."""
    ratio = _ratio(pair, metric)
    if ratio is None:
        return None
    if metric in ("median_s", "tokens_per_s"):
        change = pair.get("time_change")  # the noise-aware verdict of the compare endpoint
        time_ratio = ratio if metric == "median_s" else 1 / ratio
        if change == "slower" and time_ratio > 1 + threshold:
            return True
        if change == "faster" and time_ratio < 1 / (1 + threshold):
            return False
        return None
    higher_is_worse = metric == "peak_memory_bytes"
    if ratio > 1 + threshold:
        return higher_is_worse
    if ratio < 1 / (1 + threshold):
        return not higher_is_worse
    return None


TOO_FEW = "too few iterations to tell"
"""The compare endpoint's time_verdict for a cell whose intervals cannot tell a change."""


def untold(compare: dict[str, Any], metric: str, threshold: float) -> list[Move]:
    """The matching cells whose time moved beyond the threshold but whose intervals are too
    weak to tell it from noise (worse=False: never a regression); none for memory and length."""
    if metric not in ("median_s", "tokens_per_s"):
        return []
    found = []
    for pair in compare["pairs"]:
        ratio = _ratio(pair, "median_s")
        if pair.get("time_verdict") != TOO_FEW or ratio is None:
            continue
        if 1 / (1 + threshold) <= ratio <= 1 + threshold:
            continue
        n = f"{pair.get('a_iterations')} and {pair.get('b_iterations')} iterations"
        levels = f"{level(pair.get('a_median_ci_level'))}, {level(pair.get('b_median_ci_level'))}"
        text = (f"median_s {_fmt('median_s', pair.get('a_median_s'))} -> "
                f"{_fmt('median_s', pair.get('b_median_s'))} (B/A {ratio:.2f}): {TOO_FEW} "
                f"({n}; intervals at {levels}, below 95%)")  # fmt: skip
        found.append(Move(pair["label"], pair["a_run_id"], pair["b_run_id"], False, text))
    return found


def moves(compare: dict[str, Any], metric: str, threshold: float) -> list[Move]:
    """The matching cells of a compare answer that moved on `metric`, regressions first."""
    if metric not in METRICS:
        raise ValueError(f"--metric: one of {', '.join(METRICS)}, got {metric!r}")
    found: list[Move] = []
    for pair in compare["pairs"]:
        ids = (pair["label"], pair["a_run_id"], pair["b_run_id"])
        a_status, b_status = pair.get("a_status"), pair.get("b_status")
        if a_status == "succeeded" and b_status != "succeeded":
            found.append(Move(*ids, True, f"A succeeded, B {b_status}"))
            continue
        worse = _direction(pair, metric, threshold)
        if worse is None:
            continue
        a, b = pair.get(f"a_{metric}"), pair.get(f"b_{metric}")
        ratio = _ratio(pair, metric)
        text = f"{metric} {_fmt(metric, a)} -> {_fmt(metric, b)} (B/A {ratio:.2f}"
        if metric in ("median_s", "tokens_per_s") and pair.get("tps_lo") is not None:
            text += f"; tokens/s B/A {pair['tps_lo']:.2f}-{pair['tps_hi']:.2f}"
        found.append(Move(*ids, worse, text + ")"))
    return sorted(found, key=lambda m: not m.worse)
