"""`ringlab results` (a row per run: a table, CSV or JSON) and `ringlab report` (the sweep's
markdown report)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from service import capacity, units
from service.cli.console import CliError, client, friendly_errors, out
from service.units import MS, TimeUnit, time_unit

RESULT_COLUMNS = (
    ("run_id", "run"),
    ("label", "configuration"),
    ("status", "status"),
    ("length", "length"),
    ("median_s", "time"),
    ("tokens_per_s", "tokens/s"),
    ("peak_memory_bytes", "peak mem"),
    ("exposed_comm_share", "comm"),
    ("max_seq_len", "max len"),
    ("baseline", "vs"),
    ("speedup", "speedup"),
)
"""The terminal table: the label already names the world size, parallel mode and dtype where
they vary; a run without a time shows its status there; a speedup within noise carries ~,
one above its physical limit ⚠ with the reason below the table; every other number is in
--format csv/json. A column no row has a value for is left
out, so the table fits an 80-column terminal."""


BASELINE_TEXT = 24
"""A baseline named by more characters than this shows as its run id in the terminal table."""


def _cell(key: str, value: Any, unit: TimeUnit = MS) -> str:
    if value is None:
        return units.DASH
    if key == "speedup":
        return f"{value:.2f}x"
    if key == "status":  # the reason of each run not ok is printed below the table
        return capacity.STATUS_WORDS.get(value, value)
    if key == "exposed_comm_share":  # ring runs: time blocked on transfers / time in steps
        return units.percent(value)
    if key == "peak_memory_bytes":
        return units.nbytes(value, units=(units.MIB,), digits=1, grouped=True)
    if key == "median_s":  # one unit for the whole column, as in report.md
        return unit(value)
    if key == "tokens_per_s":
        return units.si(value)
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and key != "run_id":
        return f"{value:,}"
    return str(value)


@friendly_errors
def results(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    format_: Annotated[str, typer.Option("--format", "-f", help="table | csv | json")] = "table",
) -> None:
    """One row per run with its headline numbers, as a table, CSV or JSON."""
    if format_ not in ("table", "csv", "json"):
        raise CliError(f"--format: expected table, csv or json, got {format_!r}")
    with client() as c:
        if format_ == "csv":
            sys.stdout.write(c.results_csv(sweep_id))
            return
        rows = c.results(sweep_id)
    if format_ == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    for row in rows:
        row["length"] = row["measured_seq_len"] or row["seq_len"]  # a search: its answer
    shown = [(k, t) for k, t in RESULT_COLUMNS if any(row.get(k) is not None for row in rows)]
    unit = time_unit(row.get("median_s") for row in rows)
    table = Table(box=None, pad_edge=False, collapse_padding=True)
    for key, title in shown:
        wraps = key == "label"
        table.add_column(title, no_wrap=not wraps, overflow="fold", min_width=16 if wraps else None)
    for row in rows:
        if row.get("baseline") and len(row["baseline"]) > BASELINE_TEXT:  # several changes
            row["baseline"] = f"run {row['baseline_run_id']}"  # `ringlab report` names them
        cells = [_cell(key, row.get(key), unit) for key, _ in shown]
        if ("speedup", "speedup") in shown and row.get("speedup") is not None:
            cells[shown.index(("speedup", "speedup"))] += _speedup_note(row)
        table.add_row(*cells)
    out.print(table)
    for line in capacity.reasons(rows):  # every run not ok, with its one-line reason
        out.print(line, markup=False, highlight=False, soft_wrap=False)
    if any(_speedup_note(row) == " ~" for row in rows if row.get("speedup") is not None):
        out.print(NOISE_LEGEND, markup=False, highlight=False)
    for row in rows:  # a number above its physical limit is never shown without why
        for flag in row.get("flags") or []:
            out.print(f"⚠ run {row['run_id']}: {flag['text']}", markup=False, highlight=False)


NOISE_LEGEND = ("~ within noise: the speedup's interval (from both runs' median intervals) "
                "holds 1.00x; the two runs cannot be told apart")  # fmt: skip
"""What `~` beside a speedup means, printed under the table whenever one shows."""


def _speedup_note(row: dict[str, Any]) -> str:
    """' ⚠' beside a flagged speedup (explained below the table), ' ~' beside one whose
    interval holds 1.0 (within noise)."""
    if any(f["field"] == "speedup" for f in row.get("flags") or []):
        return " ⚠"
    return " ~" if "speedup" in (row.get("within_noise") or []) else ""


@friendly_errors
def report(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """The sweep's markdown report (tables in the style of the hand-written ones)."""
    with client() as c:
        sys.stdout.write(c.report(sweep_id))
