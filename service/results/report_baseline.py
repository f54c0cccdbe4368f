"""report.md's comparisons: each run beside its baseline (timed, and maximum lengths), and the
pivot of one metric by what varies (service.results.baselines computes every ratio).
"""

from __future__ import annotations

from collections.abc import Sequence

from service.results import baselines
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
    time_cell,
)
from service.results.rows import RunRow
from service.spec import PivotSpec
from service.units import TimeUnit, time_unit


def baseline_section(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
    """Each run beside its baseline: the seeds' 'single GPU | multi-GPU | speedup' and
    'dilation impact' tables, with both measurements shown so every ratio can be checked."""
    by_id = {r.run_id: r for r in rows}
    pairs = [(r, by_id[r.baseline_run_id]) for r in rows if r.baseline_run_id in by_id]
    bench = [(r, b) for r, b in pairs if not r.searched]
    searched = [(r, b) for r, b in pairs if r.searched]
    return (_timed_against_baseline(bench, unit) if bench else []) + (
        _max_len_against_baseline(searched) if searched else []
    )


def _timed_against_baseline(
    pairs: Sequence[tuple[RunRow, RunRow]], unit: TimeUnit | None = None
) -> list[str]:
    """(run, its baseline) of timed runs: both times with their intervals, both peaks, the
    speedup, memory ratio and scaling efficiency."""
    unit = unit or time_unit(x.median_s for pair in pairs for x in pair)
    body = (
        [r.label, f"{r.length:,}", r.baseline or "-", time_cell(b, unit), time_cell(r, unit),
         ratio_cell(r, "speedup", fmt_x),
         fmt_bytes(b.peak_memory_bytes) + marks(b, "peak_memory_bytes"),
         fmt_bytes(r.peak_memory_bytes) + marks(r, "peak_memory_bytes"),
         fmt_x(r.memory_ratio), ratio_cell(r, "efficiency", fmt_pct)]
        for r, b in pairs
    )  # fmt: skip
    header = ["Run", "Seq len", "Baseline", f"Baseline time (interval, {unit.name})",
              f"Time (interval, {unit.name})", "Speedup", "Baseline peak", "Peak",
              "Memory ratio", "Scaling efficiency"]  # fmt: skip
    return ["## Against the baseline", "", *table(header, body), ""]


def _max_len_against_baseline(pairs: Sequence[tuple[RunRow, RunRow]]) -> list[str]:
    """(run, its baseline) of searches: both maximum lengths and tokens/s at them, the gain,
    speedup and scaling efficiency."""
    body = (
        [r.label, r.baseline or "-", fmt_num(b.max_seq_len), fmt_num(r.max_seq_len),
         fmt_x(r.max_len_gain), fmt_num(b.tokens_per_s), fmt_num(r.tokens_per_s),
         ratio_cell(r, "speedup", fmt_x), ratio_cell(r, "efficiency", fmt_pct)]
        for r, b in pairs
    )  # fmt: skip
    header = ["Run", "Baseline", "Baseline max tokens", "Max tokens", "Max-length gain",
              "Baseline tokens/s at max", "Tokens/s at max", "Speedup",
              "Scaling efficiency"]  # fmt: skip
    return ["## Maximum length against the baseline", "", *table(header, body), ""]


def pivot_section(
    rows: Sequence[RunRow], spec: PivotSpec, unit: TimeUnit | None = None
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
