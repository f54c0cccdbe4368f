"""report.md's "Packed documents: balance and schemes" section: for a sweep with runs under a
documents mask, each sequence-parallel scheme (kernel) and balance side by side per length and
world size: its time, the kept-pairs imbalance, the measured compute imbalance, % of ideal and
the fastest. Every number is a field of the row (service.results.work_share defines them), so
the section reads the same as results.json; the rows need no ranks (report.report_row drops
them).

The table is a tuple of columns (COLUMNS: a header and how a row fills its cell), so a column
is one more entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from service.results.labels import SCHEME_APART, scheme_text
from service.results.report_format import table, time_cell
from service.results.rows import RunRow
from service.results.work_share import documents_mask, timed
from service.units import TimeUnit

TITLE = "Packed documents: balance and schemes"


def fmt_imbalance(x: float | None) -> str:
    """max / mean as the section writes it: 1.000 is an even share."""
    return "-" if x is None else f"{x:.3f}"


def fmt_ideal(x: float | None) -> str:
    """% of ideal to a tenth of a percent; - without a single-process run."""
    return "-" if x is None else f"{x:.1%}"


def scheme(row: RunRow) -> str:
    """The scheme as the section names it: labels.scheme_text without the balance (a column of
    its own), e.g. 'allgather_kv · gather=needed'."""
    return scheme_text(row, SCHEME_APART | {"balance"})


def _balance(row: RunRow) -> str:
    balance = row.params.get("balance")
    return "-" if balance is None else str(balance)


Cell = Callable[[RunRow, TimeUnit, bool], str]
"""How a row fills a column's cell: (row, the report's time unit, whether it is the fastest)."""

COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("scheme", lambda r, unit, best: scheme(r)),
    ("balance", lambda r, unit, best: _balance(r)),
    ("time", lambda r, unit, best: time_cell(r, unit)),
    ("kept-pairs imbalance", lambda r, unit, best: fmt_imbalance(r.kept_pairs_imbalance)),
    ("measured imbalance", lambda r, unit, best: fmt_imbalance(r.compute_imbalance)),
    ("wasted comm", lambda r, unit, best: fmt_ideal(r.wasted_comm_share)),
    ("% of ideal", lambda r, unit, best: fmt_ideal(r.ideal_fraction)),
    ("% of matmul", lambda r, unit, best: fmt_ideal(r.matmul_fraction)),
    ("fastest", lambda r, unit, best: "**fastest**" if best else ""),
)
"""The section's table, left to right."""

INTRO = (
    "Runs under a documents mask, per length and world size: each scheme and balance's time "
    "(the slowest rank's median), its kept-pairs imbalance (max / mean over the ranks of the "
    "query-key pairs each computes under the mask and balance: 1.000 is an even share), its "
    "measured imbalance (max / mean over the ranks of the step clock's compute seconds; - for "
    "a kernel without a step clock), wasted comm (the share of the K/V bytes the ranks "
    "received that kept no pair; - for a kernel that does not count them), % of ideal ((the "
    "same cell's single-process time / W) / time; - where the sweep has no W=1 run of the "
    "cell), % of matmul (each rank's FLOP/s over the node's measured matmul rate, the "
    "environment's GEMM probe) and the fastest by median time."
)


def _group_key(row: RunRow) -> tuple[int, int, str]:
    return row.length, row.world_size, row.mode


def in_documents_section(row: RunRow) -> bool:
    """Whether the section shows the run: timed over several ranks under a documents mask."""
    return documents_mask(row) and row.world_size > 1 and timed(row)


def documents_section(rows: Sequence[RunRow], unit: TimeUnit) -> list[str]:
    """The section's lines (none unless a run over several ranks ran under a documents mask):
    a table per length, world size and mode, in the rows' order within each."""
    shown = [r for r in rows if in_documents_section(r)]
    if not shown:
        return []
    groups: dict[tuple[int, int, str], list[RunRow]] = {}
    for r in shown:
        groups.setdefault(_group_key(r), []).append(r)
    lines = [f"## {TITLE}", "", INTRO, ""]
    modes = {mode for _, _, mode in groups}
    for (length, world, mode), group in sorted(groups.items()):
        fastest = min(group, key=lambda r: (r.median_s or 0.0, r.run_id)).run_id
        extra = f" · {mode}" if len(modes) > 1 else ""
        lines += [f"**{length:,} tokens · W={world}{extra}**", ""]
        lines += table(
            [header for header, _ in COLUMNS],
            ([cell(r, unit, r.run_id == fastest) for _, cell in COLUMNS] for r in group),
        )
        lines.append("")
    return lines
