"""Units a person reads: one time unit per table chosen from its values, counted nouns, an
interval's level, and the numeric order of labels.

Light on imports: the CLI uses it without loading the analysis (torch) modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["MS", "TimeUnit", "duration", "level", "levels", "natural_key", "plural", "time_unit"]


@dataclass(frozen=True)
class TimeUnit:
    """The one unit a table writes all its times in (chosen from its values by time_unit)."""

    name: str
    size: float
    digits: int = 2

    def __call__(self, s: float | None) -> str:
        """A time in this unit: 4.155 s -> '4.16 s' (s); 0.0007 s -> '0.70 ms' (ms)."""
        return "-" if s is None else f"{s / self.size:,.{self.digits}f} {self.name}"

    def bare(self, s: float) -> str:
        """The number alone (for an interval whose unit the cell already names)."""
        return f"{s / self.size:,.{self.digits}f}"


MS = TimeUnit("ms", 1e-3)


def time_unit(values: Iterable[float | None]) -> TimeUnit:
    """The unit of a table of times: the largest of s, ms, us that its largest value reaches,
    one smaller where the median would read under 0.01 there; 2 decimals (3 or 4 where the
    smallest value would round to under 0.1). 0.7 ms..224 ms: ms; 0.06 s..22.4 s: s."""
    seen = sorted(v for v in values if v is not None and v > 0)
    if not seen:
        return MS
    units = [("s", 1.0), ("ms", 1e-3), ("us", 1e-6)]
    at = next((i for i, (_, size) in enumerate(units) if seen[-1] >= size), len(units) - 1)
    if at < len(units) - 1 and seen[len(seen) // 2] / units[at][1] < 0.01:
        at += 1
    name, size = units[at]
    smallest = seen[0] / size
    digits = 2 if smallest >= 0.1 else 3 if smallest >= 0.01 else 4
    return TimeUnit(name, size, digits)


def plural(n: int, noun: str) -> str:
    """'1 run', '2 runs', '1,024 probes'."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def duration(seconds: float) -> str:
    """A wall-clock span: '46 s', '2 min 05 s', '1 h 02 min'."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def level(value: float | None) -> str:
    """What an interval covers, as a person reads it: 0.75 -> '75%', 0.96875 -> '96.9%';
    None (one iteration) -> 'no interval'."""
    return "no interval" if value is None else f"{100 * value:.3g}%"


def levels(values: Iterable[float | None]) -> str:
    """The levels of a set of intervals, lowest to highest: '75%', '75% to 99.2%', '96.9% (and
    no interval: 1 iteration)'; '' when there is no value at all."""
    seen = list(values)
    known = sorted({v for v in seen if v is not None})
    text = "" if not known else level(known[0])
    if len(known) > 1:
        text += f" to {level(known[-1])}"
    if None in seen:
        text += " (and no interval: 1 iteration)" if known else "no interval (1 iteration)"
    return text


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key reading numbers as numbers: "seq 512" < "seq 1,024" < "seq 2,048"."""
    parts = re.split(r"(\d[\d,]*(?:\.\d+)?)", text)
    return tuple(
        (1, float(p.replace(",", ""))) if i % 2 else (0, p) for i, p in enumerate(parts) if p
    )
