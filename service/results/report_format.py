"""How report.md shows a number (fmt_*, a ratio with its interval, a time with its
iterations) and a markdown table: shared by every section of the report (service.results.report)
and the pages that show the same figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from service.results.rows import RunRow
from service.units import MS, TimeUnit, bound, time_unit
from service.units import nbytes as fmt_bytes  # binary units, '-' for none


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def fmt_num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


SPANS: dict[str, Callable[[float, float], str]] = {
    "speedup": lambda lo, hi: f"{bound(lo)}-{bound(hi)}",
    "efficiency": lambda lo, hi: f"{bound(lo, 0, as_percent=True)}-{bound(hi, 0, as_percent=True)}",
    "checkpoint_time_ratio": lambda lo, hi: f"{bound(lo)}-{bound(hi)}",
}
"""The ratios that carry an interval (service.results.baselines), and how it is written."""


def marks(row: RunRow, field: str) -> str:
    """The flag marks of `field` on `row`: a warning sign and a footnote per flag code."""
    return "".join(f" ⚠[^{f.code}]" for f in row.flags_on(field))


def ratio_cell(row: RunRow, field: str, fmt: Callable[[Any], str]) -> str:
    """A ratio as the report shows it: the value, its interval (and "within noise" when the
    interval holds 1.0), then its flags' marks: "1.02x (0.95-1.10, within noise)"."""
    value = getattr(row, field)
    if value is None:
        return "-"
    text = fmt(value)
    lo, hi = getattr(row, f"{field}_lo", None), getattr(row, f"{field}_hi", None)
    if field in SPANS and lo is not None and hi is not None:
        noise = ", within noise" if field in row.within_noise else ""
        text += f" ({SPANS[field](lo, hi)}{noise})"
    return text + marks(row, field)


def time_cell(row: RunRow, unit: TimeUnit | None = None) -> str:
    """The median time with its interval and the iterations it came from: "1.00 ms
    (0.95-1.05, n=3)" (in ms); one iteration has no interval: "1.00 ms (n=1)"."""
    unit = unit or MS
    if row.median_s is None:
        return "-"
    if row.median_lo_s is None or row.median_hi_s is None:
        return f"{unit(row.median_s)} (n={row.iterations})"
    span = f"{unit.bare(row.median_lo_s)}-{unit.bare(row.median_hi_s)}"
    return f"{unit(row.median_s)} ({span}, n={row.iterations})"


FORMATS: dict[str, Callable[[Any], str]] = {
    "median_s": fmt_ms,
    "tokens_per_s": fmt_num,
    "tflops_per_s": lambda x: fmt_num(x, 4),
    "peak_memory_bytes": fmt_bytes,
    "memory_per_token_bytes": fmt_bytes,
    "max_seq_len": fmt_num,
    "speedup": fmt_x,
    "memory_ratio": fmt_x,
    "max_len_gain": fmt_x,
    "efficiency": fmt_pct,
}
"""How the report and the dashboard show each pivot metric."""


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines; `rows` is read one row at a time (a generator of a 100,000-run
    sweep's rows holds one row's cells at once, not every row's)."""
    return [*table_head(header), *(table_line(row) for row in rows)]


def table_head(header: Sequence[str]) -> list[str]:
    """A markdown table's header and rule: its body follows a line at a time (table_line)."""
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]


def table_line(cells: Sequence[str]) -> str:
    """One line of a markdown table's body, a '|' in a cell escaped."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def fmt_rate(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{fmt_bytes(bytes_per_s)}/s"


def fmt_latency(seconds: float | None) -> str:
    """A latency in microseconds (`-` when none was measured)."""
    return "-" if seconds is None else f"{seconds * 1e6:,.0f} us"


def report_unit(rows: Sequence[RunRow]) -> TimeUnit:
    """The one time unit of every table of the report, from all its runs' medians: a run's
    time reads the same in each table (not "1.45 s" in one and "1,446.6 ms" in the next)."""
    return time_unit(r.median_s for r in rows)
