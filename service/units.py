"""Units a person reads, the one place numbers become text: bytes in binary units, times (one
unit per table chosen from its values), rates, percentages, counted nouns, an interval's level,
the empty marker, and the numeric order of labels.

Two empty markers: EMPTY ('-') in report.md and the gate's lines, DASH ('—') on the pages and in
the terminal table.

Light on imports: the CLI uses it without loading the analysis (torch) modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BINARY",
    "DASH",
    "EMPTY",
    "GIB",
    "KIB",
    "MIB",
    "MS",
    "TIB",
    "B",
    "ByteUnit",
    "TimeUnit",
    "byte_unit",
    "duration",
    "figure",
    "kilo",
    "level",
    "levels",
    "micros",
    "natural_key",
    "nbytes",
    "percent",
    "plural",
    "rate",
    "secs",
    "si",
    "time_unit",
]

EMPTY = "-"
"""What a missing number reads as in report.md and the regression gate's lines."""
DASH = "—"
"""What a missing number reads as on the pages and in the terminal's results table."""


@dataclass(frozen=True)
class ByteUnit:
    """A binary unit of bytes: its name and its size in bytes."""

    name: str
    size: int

    def of(self, n: float) -> float:
        """n bytes in this unit (a chart's axis value): 1.5 GiB -> 1.5."""
        return n / self.size

    def text(self, n: float, digits: int, grouped: bool) -> str:
        """n bytes in this unit, to `digits` decimals (with thousands separators: grouped)."""
        return f"{n / self.size:{',' if grouped else ''}.{digits}f} {self.name}"


B = ByteUnit("B", 1)
KIB = ByteUnit("KiB", 1 << 10)
MIB = ByteUnit("MiB", 1 << 20)
GIB = ByteUnit("GiB", 1 << 30)
TIB = ByteUnit("TiB", 1 << 40)
BINARY = (TIB, GIB, MIB, KIB, B)
"""Every unit, largest first: nbytes writes a size in the largest one it reaches."""


def nbytes(
    n: float | None,
    *,
    units: Sequence[ByteUnit] = BINARY,
    digits: int = 2,
    grouped: bool = False,
    empty: str = EMPTY,
) -> str:
    """A size in the largest of `units` it reaches (the last when it reaches none), to `digits`
    decimals (whole bytes in B): 1536 -> '1.50 KiB', 100 -> '100 B', None -> `empty`.

    report.md and the pages use the defaults (the pages with empty=DASH); the sequence-parallel
    table writes MiB or KiB to one decimal, grouped (units=(MIB, KIB), digits=1, grouped=True);
    the terminal table and the regression gate MiB alone to one decimal (units=(MIB,),
    digits=1; the terminal grouped)."""
    if n is None:
        return empty
    unit = next((u for u in units if abs(n) >= u.size), units[-1])
    return unit.text(n, 0 if unit is B else digits, grouped)


def byte_unit(values: Iterable[float], units: Sequence[ByteUnit] = (GIB, MIB, KIB)) -> ByteUnit:
    """The one unit of a memory axis: the largest of `units` its largest value reaches, else the
    last (GiB from 1 GiB, else MiB from 1 MiB, else KiB)."""
    top = max(values, default=0)
    return next((u for u in units if top >= u.size), units[-1])


def kilo(n: float | None, empty: str = DASH) -> str:
    """Thousands to one decimal (decimal kilo): 8224 bytes per token -> '8.2' (KB)."""
    return empty if n is None else f"{n / 1000:,.1f}"


def si(value: float | None, unit: str = "", empty: str = DASH) -> str:
    """An SI-prefixed number to 3 significant digits: 1234567 -> '1.23 M' + unit."""
    if value is None:
        return empty
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def secs(value: float | None, empty: str = DASH) -> str:
    """A time alone, to 3 significant digits: 0.0123 -> '12.3 ms', 4.2 -> '4.2 s'."""
    if value is None:
        return empty
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def micros(seconds: float | None, unit: str = "µs", empty: str = DASH) -> str:
    """A latency in whole microseconds: 4.2e-05 -> '42 µs' (report.md writes unit='us')."""
    return empty if seconds is None else f"{seconds * 1e6:,.0f} {unit}"


def percent(fraction: float | None, digits: int = 0, empty: str = DASH) -> str:
    """A fraction as a percentage: 0.123 -> '12%' (digits=0), '12.3%' (digits=1)."""
    return empty if fraction is None else f"{fraction:.{digits}%}"


def bound(ratio: float, digits: int = 2, *, as_percent: bool = False) -> str:
    """An interval's bound at `digits` decimals, with as many more as it takes to keep a bound
    that is not 1 from reading 1 (0.99957 -> '0.9996', not '1.00': that interval does not hold
    1.0, and a reader must not see it as within noise); `as_percent`: '99.96%', not '100%'."""
    scale, suffix = (100.0, "%") if as_percent else (1.0, "")
    shown = f"{ratio * scale:.{digits}f}"
    while ratio != 1.0 and float(shown) == scale and digits < 8:
        digits += 1
        shown = f"{ratio * scale:.{digits}f}"
    return shown + suffix


RATE_UNITS = (
    ("tflops_per_s", ""),  # already in TFLOP/s
    ("flops_per_s", "FLOP/s"),
    ("tokens_per_s", "tok/s"),
    ("bytes_per_s", ""),  # binary units
    ("_per_s", "/s"),
)
"""How a rate's name ends, and the unit its value is shown in."""


def rate(value: float, name: str) -> str:
    """A rate by its name: TFLOP/s as stored, bytes/s in binary units, others SI-prefixed."""
    suffix, unit = next((s, u) for s, u in RATE_UNITS if name.endswith(s))
    if suffix == "tflops_per_s":
        return f"{value:.4g} TFLOP/s"
    if suffix == "bytes_per_s":
        return f"{nbytes(value, empty=DASH)}/s"
    return si(value, unit)


def figure(value: float | str | bool, name: str) -> str:
    """A figure by its name's unit: seconds (`_s`), bytes (`_bytes`), rates (`_per_s`), other
    numbers to 4 significant digits or with separators; text as it is."""
    if isinstance(value, bool | str):
        return str(value)
    if name.endswith("_per_s"):
        return rate(value, name)
    if name.endswith("_s"):
        return secs(value)
    if name.endswith("_bytes"):
        return nbytes(value, empty=DASH)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


@dataclass(frozen=True)
class TimeUnit:
    """The one unit a table writes all its times in (chosen from its values by time_unit)."""

    name: str
    size: float
    digits: int = 2

    def __call__(self, s: float | None) -> str:
        """A time in this unit: 4.155 s -> '4.16 s' (s); 0.0007 s -> '0.70 ms' (ms)."""
        return EMPTY if s is None else f"{s / self.size:,.{self.digits}f} {self.name}"

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
