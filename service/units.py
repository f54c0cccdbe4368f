"""Units a person reads: one time unit per table chosen from its values, and counted nouns.

Light on imports: the CLI uses it without loading the analysis (torch) modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MS", "TimeUnit", "duration", "plural", "time_unit"]


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
