"""What the results routes render, one function each: the sweep and its rows read once per
answer (report.md, pivot.csv, components.csv, a comparison of two sweeps, the streamed
results.json and results.csv), so a route only parses its request, calls one of these and
returns what it gets.

A whole-sweep answer is read inside queries.whole_sweep_read (WholeSweepBusy when another large
one runs); a sweep that does not exist is SweepNotFound.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import Run, RunStatus, Sweep
from service.results import baselines, export, queries
from service.results.compare import Sides, compare_head, iter_pairs, pair_out, same_spec
from service.results.report import PivotChoice, report_row, write_report
from service.results.rows import RunRow
from service.spec import PivotSpec


class SweepNotFound(LookupError):
    """No sweep with this id (the API answers 404)."""

    def __init__(self, sweep_id: int) -> None:
        super().__init__(f"sweep {sweep_id} not found")
        self.sweep_id = sweep_id


def _sweep(session: Session, sweep_id: int) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise SweepNotFound(sweep_id)
    return sweep


def _sweep_rows(session: Session, sweep_id: int) -> tuple[Sweep, list[RunRow]]:
    """The sweep and every run of it as a row (inside whole_sweep_read)."""
    sweep = _sweep(session, sweep_id)
    return sweep, queries.sweep_rows(session, sweep)


def _run_counts(session: Session, sweep_id: int) -> dict[str, int]:
    """Runs per status, every status present (zeros included), in RunStatus's order."""
    counts = {str(s): 0 for s in RunStatus}
    found = session.execute(
        select(Run.status, func.count()).where(Run.sweep_id == sweep_id).group_by(Run.status)
    )
    for status, n in found:
        counts[str(RunStatus(status))] = n
    return counts


def sweep_report(session: Session, sweep_id: int) -> str:
    """report.md: the sweep, its runs read twice a page at a time (report.write_report: the
    totals and the tables' columns, then the tables a line at a time), its environments and
    run counts; its pivot is the sweep's analysis block's (or the default for its rows)."""
    with queries.whole_sweep_read(session, sweep_id):
        sweep = _sweep(session, sweep_id)
        analysis = queries.analysis_of(sweep)
        return write_report(
            sweep,
            _SweepRuns(session, sweep),
            queries.sweep_environments(session, sweep_id),
            _run_counts(session, sweep_id),
            PivotChoice(analysis.pivot if analysis is not None else None, default=True),
            keep=report_row,
        )


class _SweepRuns:
    """A sweep's runs as report.md reads them (report.ReportRuns): rows built READ_PAGE at a
    time (labels, baselines and ratios as for the whole sweep: queries.rows_page), each page
    dropped once read."""

    def __init__(self, session: Session, sweep: Sweep) -> None:
        self.session, self.sweep = session, sweep

    def first(self) -> Iterator[RunRow]:
        after = 0
        while page := queries.rows_page(self.session, self.sweep, after=after, limit=READ_PAGE):
            yield from page
            after = page[-1].run_id

    def in_order(self, ids: Sequence[int]) -> Iterator[RunRow]:
        for start in range(0, len(ids), READ_PAGE):
            chosen = ids[start : start + READ_PAGE]
            found = {
                r.run_id: r for r in queries.rows_page(self.session, self.sweep, run_ids=chosen)
            }
            yield from (found.pop(i) for i in chosen if i in found)


def sweep_pivot_csv(session: Session, sweep_id: int, changes: dict[str, Any]) -> str:
    """pivot.csv: the sweep's pivot (its analysis block's, else the default, else time by
    length) with `changes` (rows, columns, value) applied; pydantic's ValidationError names a
    change that makes no pivot."""
    with queries.whole_sweep_read(session, sweep_id):
        sweep, rows = _sweep_rows(session, sweep_id)
        spec = baselines.pivot_spec(queries.analysis_of(sweep), rows) or PivotSpec()
        spec = PivotSpec.model_validate({**spec.model_dump(), **changes})
        return export.pivot_csv(rows, spec)


def sweep_components_csv(session: Session, sweep_id: int) -> str:
    """components.csv: every model run's memory components (its limiting rank)."""
    with queries.whole_sweep_read(session, sweep_id):
        return export.components_csv(_sweep_rows(session, sweep_id)[1])


READ_PAGE = 1_000
"""Runs whose full rows a report or a comparison builds at once before it keeps only what it
reads of them (each pass of report.write_report, compare.Sides)."""


def sweep_sides(session: Session, sweep: Sweep) -> Sides:
    """Every run of the sweep as a comparison's Sides, in id order: rows built READ_PAGE at a
    time (labels as for the whole sweep: queries.rows_page), each page dropped once packed."""
    return Sides(_SweepRuns(session, sweep).first())


@dataclass(frozen=True)
class Comparison:
    """Sweep A and sweep B cell by cell: the counts and whether their specs are the same
    (head, compare.compare_head), and both sweeps' sides, from which the pairs come one at a
    time."""

    head: dict[str, Any]
    a: Sides
    b: Sides

    def pairs(self) -> Iterator[dict[str, Any]]:
        """The pairs in A's order (compare.iter_pairs), each as the API gives it (pair_out)."""
        return (pair_out(p) for p in iter_pairs(self.a, self.b))


def sweep_comparison(session: Session, a_id: int, b_id: int) -> Comparison:
    """Sweep A and sweep B cell by cell (compare.compare_head and iter_pairs): their sides
    read and packed, ~150 bytes a run, the pairs never all at once."""
    with queries.whole_sweep_read(session, a_id, b_id):
        a, b = _sweep(session, a_id), _sweep(session, b_id)
        a_sides, b_sides = sweep_sides(session, a), sweep_sides(session, b)
        head = compare_head(a_id, b_id, a_sides, b_sides, same_spec(a.spec, b.spec))
        return Comparison(head, a_sides, b_sides)


EXPORT_PAGE = 1_000
"""Runs per page of a streamed export: its memory stays one page whatever the sweep's size."""


def result_pages(factory: sessionmaker[Session], sweep_id: int) -> Iterator[list[dict[str, Any]]]:
    """The sweep's result rows in id order, EXPORT_PAGE at a time, each page read in its own
    short session (labels and baselines as for the whole sweep: queries.rows_page)."""
    after = 0
    while True:
        with factory() as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None:  # aborts the response: a cut-off export must not look whole
                raise RuntimeError(f"sweep {sweep_id} was deleted during its export")
            page = queries.rows_page(session, sweep, after=after, limit=EXPORT_PAGE)
        if not page:
            return
        yield [export.result_row(r) for r in page]
        after = page[-1].run_id


def results_json_chunks(factory: sessionmaker[Session], sweep_id: int) -> Iterator[str]:
    """results.json streamed: one chunk per page (each chunk is a hop to the thread pool and
    a write)."""
    yield "["
    sep = ""
    for page in result_pages(factory, sweep_id):
        yield sep + ",".join(export.ResultRow(**row).model_dump_json() for row in page)
        sep = ","
    yield "]"


def results_csv_chunks(factory: sessionmaker[Session], sweep_id: int) -> Iterator[str]:
    """results.csv streamed: its header line, then one chunk per page."""
    yield export.to_csv([])
    for page in result_pages(factory, sweep_id):
        yield export.to_csv(page, header=False)


WARM_CONTEXT_RUNS = 2_000
"""Sweeps over this many runs have their context found as soon as they are stored."""


def warm_context(factory: sessionmaker[Session], sweep_id: int) -> None:
    """Find the sweep's context (queries.sweep_context: what varies, each run's baselines)
    now, in its own session: it depends on configs alone, fixed once stored, so a large
    sweep's first page (its labels and baselines) then reads a page of runs, not a pass over
    all of them (~6 s for 100,000). A process that starts later finds it at its first read."""
    with factory() as session:
        sweep = session.get(Sweep, sweep_id)
        if sweep is not None:  # deleted in the meantime: nothing to find
            queries.sweep_context(session, sweep)


def sweep_exists(session: Session, sweep_id: int) -> None:
    """SweepNotFound unless the sweep exists (checked before a stream starts: a missing sweep
    is a 404, not a broken stream)."""
    _sweep(session, sweep_id)
