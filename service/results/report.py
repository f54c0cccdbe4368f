"""report.md of a sweep's rows (service.results.rows, service.results.baselines): the tables a
researcher writes by hand today. This module writes the heading, the setup, what the figures
mean, the warnings and the footnotes, and puts the sections in order; each family of sections
has its module (report_runs, report_baseline, report_training, report_environment), all
formatting through report_format.

No number is computed here: every value is a field of the row; this module only picks and
formats them, so the report, the CSV and the dashboard cannot disagree.

A sweep's report is written from two reads of its runs (write_report): the first finds what is
said of all of them (report_plan.ReportPlan), the second writes the tables a line at a time, so
a 100,000-run sweep's report never holds its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from service.db.models import Environment, Sweep
from service.results.export import result_row
from service.results.labels import AxisRow
from service.results.pivot import default_pivot
from service.results.plans import chosen_on_device, plan_notes
from service.results.report_baseline import (
    BaselineCells,
    max_len_head,
    max_len_line,
    pivot_section,
    timed_head,
    timed_line,
)
from service.results.report_documents import documents_section, in_documents_section
from service.results.report_environment import compile_notes, environment_section
from service.results.report_plan import PROTOCOL_FIELDS, SETUP_FIELDS, ReportPlan, pivot_fields
from service.results.report_runs import (
    ResultsLayout,
    comm_line,
    in_comm_table,
    max_len_section,
    phase_head,
    phase_line,
    phased,
    probe_sections,
    results_foot,
    results_head,
    results_line,
)
from service.results.report_training import model_sections
from service.results.rows import RunRow
from service.results.schemes import SCHEMES, sp_schemes_section
from service.results.stored import StoredRank
from service.spec import PivotSpec
from service.units import TimeUnit, levels


def _kernels_as_run(shared: dict[str, dict[str, str]]) -> list[str]:
    """'**Kernels as run**: ring: layout=zigzag · ulysses: inner=dense': each kernel's params
    that every one of its runs shares, as stored (resolved defaults included), so what ran is
    written even where the labels name only what varies; nothing when no kernel has any."""
    parts = [
        f"{kernel}: " + " · ".join(f"{k}={v}" for k, v in sorted(params.items()))
        for kernel, params in sorted(shared.items())
        if params
    ]
    return ["**Kernels as run**: " + "; ".join(parts), ""] if parts else []


class ReportRuns(Protocol):
    """Where report.md reads its runs, twice: every run for its first pass (ReportPlan), then
    the runs in the report's order for its tables."""

    def first(self) -> Iterable[RunRow]:
        """Every run, in id order."""
        ...

    def in_order(self, ids: Sequence[int]) -> Iterable[RunRow]:
        """The runs `ids` that exist, in that order."""
        ...


class ListedRuns:
    """Runs already read (a test's, one run's): both passes read the list."""

    def __init__(self, rows: Sequence[RunRow]) -> None:
        self.rows = rows

    def first(self) -> Iterable[RunRow]:
        return self.rows

    def in_order(self, ids: Sequence[int]) -> Iterable[RunRow]:
        by_id = {r.run_id: r for r in self.rows}
        return (by_id[i] for i in ids if i in by_id)


@dataclass(frozen=True)
class PivotChoice:
    """The report's pivot: `given`, else (`default`) the default for its runs
    (pivot.default_pivot), else none."""

    given: PivotSpec | None
    default: bool

    @property
    def metric(self) -> str:
        """The field it shows (the default pivot's: time)."""
        return self.given.value if self.given is not None else PivotSpec().value

    def spec(self, rows: Sequence[AxisRow]) -> PivotSpec | None:
        spec = self.given or (default_pivot(rows) if self.default else None)
        if spec is not None and spec.value != self.metric:
            raise ValueError(f"the pivot shows {spec.value}, its rows carry {self.metric}")
        return spec


def report_markdown(
    sweep: Sweep,
    rows: Sequence[RunRow],
    environments: Sequence[Environment],
    counts: dict[str, int],
    pivot_spec: PivotSpec | None,
) -> str:
    """A markdown report of a sweep in the style of the reports users write by hand, from its
    rows already read."""
    return write_report(
        sweep, ListedRuns(rows), environments, counts, PivotChoice(pivot_spec, default=False)
    )


def write_report(
    sweep: Sweep,
    runs: ReportRuns,
    environments: Sequence[Environment],
    counts: dict[str, int],
    pivot: PivotChoice,
    keep: Callable[[RunRow], RunRow] = lambda row: row,
) -> str:
    """report.md in two passes over `runs`: the first (ReportPlan) finds the totals, the time
    unit, the tables' columns and the pivot; the second reads the runs in the report's order
    and writes each table a line at a time, keeping only the rows of the few sections that
    are made over whole rows (schemes, model cells, searches, compilations, plans), each as
    `keep` leaves it."""
    plan = ReportPlan(pivot.metric, pivot_fields(pivot.given))
    for r in runs.first():
        plan.add(r)
    unit = plan.unit()
    cells = {b.run_id: BaselineCells.of(b, unit) for b in runs.in_order(sorted(plan.baseline_ids))}
    tables = _Tables(plan.layout, unit, cells, keep)
    for r in runs.in_order(plan.order()):
        tables.add(r)
    lines = _preamble(sweep, plan, counts) + tables.lines()
    spec = pivot.spec(plan.pivot_rows)
    if spec is not None:
        lines += pivot_section(plan.pivot_rows, spec, unit)
    searched = tables.searched
    if searched:
        lines += max_len_section(searched, unit)
        lines += probe_sections(searched, unit)
    lines += environment_section(environments)
    lines += compile_notes(tables.noted) + plan_notes(tables.noted)
    lines += flag_footnotes(plan)
    return "\n".join(lines)


class _Tables:
    """The second pass (add() each run, in the report's order): every table over all runs
    written a line at a time, and the rows of the sections made over few runs kept."""

    def __init__(
        self,
        layout: ResultsLayout,
        unit: TimeUnit,
        baselines: dict[int, BaselineCells],
        keep: Callable[[RunRow], RunRow],
    ) -> None:
        self.layout, self.unit, self.baselines, self.keep = layout, unit, baselines, keep
        self.results: list[str] = []
        self.comm: list[str] = []
        self.phase: list[str] = []
        self.timed: list[str] = []
        self.max_len: list[str] = []
        self.schemes: list[dict[str, Any]] = []
        self.models: list[RunRow] = []
        self.documents: list[RunRow] = []
        self.searched: list[RunRow] = []
        self.noted: list[RunRow] = []
        """Runs that compiled or chose their plan on the device (the environment's notes)."""

    def add(self, r: RunRow) -> None:
        if not r.searched:
            self.results.append(results_line(r, self.layout, self.unit))
            if in_comm_table(r):
                self.comm.append(comm_line(r))
            if phased(r):
                self.phase.append(phase_line(r, self.unit))
        base = self.baselines.get(r.baseline_run_id) if r.baseline_run_id is not None else None
        if base is not None and r.searched:
            self.max_len.append(max_len_line(r, base))
        elif base is not None:
            self.timed.append(timed_line(r, base, self.unit))
        model, noted = r.workload == "model", _compiled(r) or chosen_on_device(r)
        documents = in_documents_section(r)
        if not (model or r.searched or noted or documents or _scheme_run(r)):
            return
        kept = self.keep(r)  # what the sections below read of it, as they always read it
        if _scheme_run(kept):
            self.schemes.append(result_row(kept))
        self.documents += [kept] if documents else []
        self.models += [kept] if model else []
        self.searched += [kept] if kept.searched else []
        self.noted += [kept] if noted else []

    def lines(self) -> list[str]:
        """The tables from the results to the model cells', in the report's order."""
        lines = []
        if self.results:
            lines += results_head(self.layout) + self.results
            lines += results_foot(self.layout, self.comm)
        if self.phase:
            lines += [*phase_head(), *self.phase, ""]
        if self.timed:
            lines += [*timed_head(self.unit), *self.timed, ""]
        if self.max_len:
            lines += [*max_len_head(), *self.max_len, ""]
        lines += sp_schemes_section(self.schemes)
        lines += documents_section(self.documents, self.unit)
        if self.models:
            lines += model_sections(self.models, self.unit)
        return lines


def _compiled(r: RunRow) -> bool:
    """Whether a rank of the run recorded a compilation (compile_notes)."""
    return any(rank.compilations and rank.compile_s is not None for rank in r.ranks)


def report_row(row: RunRow) -> RunRow:
    """The row as report.md keeps it where a section is made over whole rows (model cells,
    searches, schemes, the environment's notes): its ranks (~2.5 KB a run) dropped unless one
    holds what the report reads of a rank (report_runs: a peak below its inputs, the device's
    used bytes; report_environment.compile_notes: compilations). Every other figure of a rank
    is already the row's own (rank_peak_bytes, the slowest's times)."""
    if not any(_read_of_rank(rank) for rank in row.ranks):
        row.ranks = []
    return row


def _read_of_rank(rank: StoredRank) -> bool:
    return (
        rank.peak_below_inputs
        or rank.device_used_bytes is not None
        or bool(rank.compilations and rank.compile_s is not None)
    )


def _scheme_run(row: RunRow) -> bool:
    """Whether sp_schemes_section reads the row: a succeeded scheme on several ranks (the
    others are left out before their result rows, ~3.5 KB each, are made)."""
    return row.kernel in SCHEMES and row.world_size > 1 and row.status == "succeeded"


DEFINITIONS = (
    "Time is the slowest rank's median per iteration (p10-p90 of that rank beside it); "
    "tokens/s = batch_size x measured length / time; TFLOP/s = FLOPs summed over ranks / "
    "time (attention FLOPs 4·b·s·s·h·d, halved for causal, x3.5 for forward+backward, only "
    "computed blocks for sparse kernels); peak memory is each rank's own, reset for the "
    "case; memory/token divides the largest rank peak by the tokens that rank holds. "
    "Ratios compare each run with its baseline (named in the Baseline column): speedup = "
    "tokens/s / baseline tokens/s, memory ratio = peak / baseline peak, max-length gain = "
    "max tokens / baseline max tokens, scaling efficiency = gain / world-size ratio. "
    "The noise: a time's interval is the confidence interval of the slowest rank's median "
    "(order statistics): at 95% or more from 6 iterations; with 2-5 iterations the range of "
    "all of them, which covers less (median_ci_level in results.json; the level these runs "
    "reached is stated below); a ratio of times carries (lo-hi) = a_lo / b_hi "
    "to a_hi / b_lo from both runs' intervals, and says within noise when that holds 1.0. "
    "Peak memory and maximum length are one measurement each: their ratios have no "
    "interval. A number above its physical limit carries ⚠ and a footnote."
)
"""What the report's figures mean, said once under its heading."""


def interval_line(plan: ReportPlan) -> list[str]:
    """What the report's time intervals cover, from the iterations that ran: the level is
    stated, never assumed to be 95%."""
    if not plan.timed:
        return []
    counts = sorted(plan.iterations)
    n = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"
    covers = levels([*plan.ci_levels, *([None] if plan.no_interval else [])])
    line = f"**Intervals**: the median intervals here cover {covers} ({n} iterations per run)."
    if plan.below_confidence:
        line += (" Below 95% (fewer than 6 iterations) is too few iterations to tell a "
                 "change from noise: the compare page and `ringlab compare` say so rather "
                 "than calling a regression.")  # fmt: skip
    return [line, ""]


def _preamble(sweep: Sweep, plan: ReportPlan, counts: dict[str, int]) -> list[str]:
    """The report's heading, its errors, the setup and protocol every run shares, what the
    figures mean, and the warnings (flagged results, runs timed beside others)."""
    created = sweep.created_at.strftime("%Y-%m-%d %H:%M")
    state = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no runs"
    lines = [
        f"# {sweep.name}",
        "",
        f"Sweep {sweep.id} · kind `{sweep.kind}` · created {created} UTC · "
        f"{plan.runs} runs: {state}",
        "",
    ]
    if plan.errors:
        lines += ["## Errors", "", *plan.errors, ""]
    for title, names in (("Setup", SETUP_FIELDS), ("Protocol", PROTOCOL_FIELDS)):
        shared = plan.fixed(names)
        if shared:
            lines += [f"**{title}**: " + " · ".join(f"{k}={v}" for k, v in shared.items()), ""]
    lines += _kernels_as_run(plan.kernels)
    lines += [DEFINITIONS, "", *interval_line(plan)]
    if plan.flagged:
        lines += [
            f"**{plan.flagged} of {plan.runs} runs show a result above its physical limit** "
            "(marked ⚠, explained in the footnotes): read those numbers as suspect.",
            "",
        ]
    return lines + _cotenant_lines(plan)


FLAG_TITLES = {
    "speedup_above_world_size": "Speedup above the world-size ratio (W / baseline W), beyond "
    "the noise: more ranks cannot do more than their share; suspect contention in the "
    "baseline (threads, cores) or a mismeasured run.",
    "efficiency_above_100": "Scaling efficiency above 100% (beyond the noise where the run "
    "has an interval; a maximum length has none).",
    "peak_below_inputs": "Peak memory below the inputs the rank held while it was metered: "
    "the peak includes them, so the meter missed memory.",
}
"""The footnote each flag code opens with (service.results.baselines and
service.results.rows_build raise them)."""


def flag_footnotes(plan: ReportPlan) -> list[str]:
    """One footnote per flag code raised in the runs: what it means, then each run's own
    sentence (markdown footnotes; the ⚠[^code] marks point here)."""
    lines: list[str] = []
    for code, texts in plan.footnotes.items():
        lines.append(f"[^{code}]: {FLAG_TITLES.get(code, code)}")
        lines += [f"    - {t}" for t in texts]
        lines.append("")
    return lines


def _cotenant_lines(plan: ReportPlan) -> list[str]:
    """A note naming the runs timed while other runs' gangs shared their nodes (their times
    may include contention for CPU, memory bandwidth or the link); none when each ran alone."""
    if not plan.cotenants:
        return []
    named = "; ".join(
        f"run {run_id} beside {', '.join(str(c) for c in cotenants)}"
        for run_id, cotenants in sorted(plan.cotenants)
    )
    return [
        f"**{len(plan.cotenants)} of {plan.runs} runs were timed while other runs shared their "
        f"nodes** ({named}): their times may include contention; `isolation: node` times a run "
        "alone.",
        "",
    ]
