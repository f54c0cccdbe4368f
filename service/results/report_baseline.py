"""report.md's comparisons: each run beside its baseline (timed, and maximum lengths), and the
pivot of one metric by what varies (service.results.baselines computes every ratio).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.results import baselines
from service.results.labels import AxisRow
from service.results.report_format import (
    FORMATS,
    SPANS,
    fmt_bytes,
    fmt_num,
    fmt_pct,
    fmt_x,
    marks,
    ratio_cell,
    table,
    table_head,
    table_line,
    time_cell,
)
from service.results.rows import RunRow
from service.spec import PivotSpec
from service.units import TimeUnit, time_unit


@dataclass(frozen=True, slots=True)
class BaselineCells:
    """What the comparisons show of a run as another's baseline, written once the report's
    time unit is known: a run's baseline may come before it, after it, or in another page of
    the sweep, so its cells are kept rather than its row."""

    time: str
    """Its time with interval and iterations (time_cell)."""
    peak: str
    """Its peak memory, marked."""
    max_tokens: str
    tokens_per_s: str

    @classmethod
    def of(cls, b: RunRow, unit: TimeUnit) -> BaselineCells:
        return cls(
            time_cell(b, unit),
            fmt_bytes(b.peak_memory_bytes) + marks(b, "peak_memory_bytes"),
            fmt_num(b.max_seq_len),
            fmt_num(b.tokens_per_s),
        )


def timed_head(unit: TimeUnit) -> list[str]:
    """Each timed run beside its baseline: the seeds' 'single GPU | multi-GPU | speedup' and
    'dilation impact' tables, with both measurements shown so every ratio can be checked;
    the lines are timed_line's (a run whose baseline is in the sweep), then a blank line."""
    header = ["Run", "Seq len", "Baseline", f"Baseline time (interval, {unit.name})",
              f"Time (interval, {unit.name})", "Speedup", "Baseline peak", "Peak",
              "Memory ratio", "Scaling efficiency"]  # fmt: skip
    return ["## Against the baseline", "", *table_head(header)]


def timed_line(r: RunRow, b: BaselineCells, unit: TimeUnit) -> str:
    """(run, its baseline) of a timed run: both times with their intervals, both peaks, the
    speedup, memory ratio and scaling efficiency."""
    return table_line(
        [r.label, f"{r.length:,}", r.baseline or "-", b.time, time_cell(r, unit),
         ratio_cell(r, "speedup", fmt_x), b.peak,
         fmt_bytes(r.peak_memory_bytes) + marks(r, "peak_memory_bytes"),
         fmt_x(r.memory_ratio), ratio_cell(r, "efficiency", fmt_pct)]
    )  # fmt: skip


def max_len_head() -> list[str]:
    """Each search beside its baseline's; the lines are max_len_line's, then a blank line."""
    header = ["Run", "Baseline", "Baseline max tokens", "Max tokens", "Max-length gain",
              "Baseline tokens/s at max", "Tokens/s at max", "Speedup",
              "Scaling efficiency"]  # fmt: skip
    return ["## Maximum length against the baseline", "", *table_head(header)]


def max_len_line(r: RunRow, b: BaselineCells) -> str:
    """(run, its baseline) of a search: both maximum lengths and tokens/s at them, the gain,
    speedup and scaling efficiency."""
    return table_line(
        [r.label, r.baseline or "-", b.max_tokens, fmt_num(r.max_seq_len),
         fmt_x(r.max_len_gain), b.tokens_per_s, fmt_num(r.tokens_per_s),
         ratio_cell(r, "speedup", fmt_x), ratio_cell(r, "efficiency", fmt_pct)]
    )  # fmt: skip


def pivot_section(
    rows: Sequence[AxisRow], spec: PivotSpec, unit: TimeUnit | None = None
) -> list[str]:
    """The pivot: a table per section (what else varies, in its heading), the same columns in
    each, so a column is one kind of run all the way down; times in one unit for all of them."""
    grid = baselines.pivot(rows, spec)
    if not grid.columns or not grid.sections:
        return []
    show = FORMATS[spec.value]
    if spec.value == "median_s":
        show = unit or time_unit(v for _, values in grid.rows for v in values)
    title = baselines.PIVOT_VALUES[spec.value]
    lines = [
        f"## {title[0].upper() + title[1:]} by {grid.row_header} and {grid.column_header}",
        "",
    ]
    if spec.value in SPANS:
        lines += [
            "Each ratio's interval and whether it is within noise: see Against the baseline.",
            "",
        ]
    header = [grid.row_header[0].upper() + grid.row_header[1:], *grid.columns]
    for section in grid.sections:
        body = (
            [name, *(show(v) + _flag_marks(section.flags.get((i, j), [])) for j, v in
                     enumerate(values))]
            for i, (name, values) in enumerate(section.rows)
        )  # fmt: skip
        lines += [f"### {section.title}", ""] if section.title else []
        lines += [*table(header, body), ""]
    return lines


def _flag_marks(codes: Sequence[str]) -> str:
    return "".join(f" ⚠[^{code}]" for code in codes)
