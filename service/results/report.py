"""report.md of a sweep's rows (service.results.rows, service.results.baselines): the tables a
researcher writes by hand today. This module writes the heading, the setup, what the figures
mean, the warnings and the footnotes, and puts the sections in order; each family of sections
has its module (report_runs, report_baseline, report_training, report_environment), all
formatting through report_format.

No number is computed here: every value is a field of the row; this module only picks and
formats them, so the report, the CSV and the dashboard cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.db.models import Environment, Sweep
from service.results.export import result_row
from service.results.labels import value_text
from service.results.plans import plan_notes
from service.results.report_baseline import baseline_section, pivot_section
from service.results.report_documents import documents_section
from service.results.report_environment import compile_notes, environment_section
from service.results.report_format import report_unit
from service.results.report_runs import (
    max_len_section,
    phase_section,
    probe_sections,
    results_section,
)
from service.results.report_training import model_sections
from service.results.rows import RunRow
from service.results.schemes import SCHEMES, sp_schemes_section
from service.results.stored import StoredRank
from service.spec import PivotSpec, canonical_json
from service.units import levels, natural_key
from workers.noise import CONFIDENCE

SETUP_FIELDS = ("batch_size", "num_heads", "head_dim", "dtype", "causal", "mode", "parallel")
PROTOCOL_FIELDS = ("device", "warmup", "iterations", "placement", "fresh_processes")


def _fixed(rows: Sequence[RunRow], fields: Sequence[str]) -> dict[str, Any]:
    """The fields every row shares, with their value."""
    out = {}
    for f in fields:
        values = {canonical_json(r.config.get(f)) for r in rows}
        if len(values) == 1 and rows:
            out[f] = rows[0].config.get(f)
    return out


def _kernels_as_run(rows: Sequence[RunRow]) -> list[str]:
    """'**Kernels as run**: ring: layout=zigzag · ulysses: inner=dense': each kernel's params
    that every one of its runs shares, as stored (resolved defaults included), so what ran is
    written even where the labels name only what varies; nothing when no kernel has any."""
    shared: dict[str, dict[str, str]] = {}
    for r in rows:
        params = {k: value_text(v) for k, v in r.params.items() if v is not None}
        if r.kernel not in shared:
            shared[r.kernel] = params
        else:
            seen = shared[r.kernel]
            shared[r.kernel] = {k: v for k, v in seen.items() if params.get(k) == v}
    parts = [
        f"{kernel}: " + " · ".join(f"{k}={v}" for k, v in sorted(params.items()))
        for kernel, params in sorted(shared.items())
        if params
    ]
    return ["**Kernels as run**: " + "; ".join(parts), ""] if parts else []


def report_markdown(
    sweep: Sweep,
    rows: Sequence[RunRow],
    environments: Sequence[Environment],
    counts: dict[str, int],
    pivot_spec: PivotSpec | None,
) -> str:
    """A markdown report of a sweep in the style of the reports users write by hand."""
    lines = _preamble(sweep, rows, counts)
    ordered = sorted(rows, key=row_order)
    unit = report_unit(rows)
    bench = [r for r in ordered if not r.searched]
    if bench:
        lines += results_section(bench, unit)
        lines += phase_section(bench, unit)
    lines += baseline_section(ordered, unit)
    lines += sp_schemes_section([result_row(r) for r in ordered if _scheme_run(r)])
    lines += documents_section(ordered, unit)
    models = [r for r in ordered if r.workload == "model"]
    if models:
        lines += model_sections(models, unit)
    if pivot_spec is not None:
        lines += pivot_section(rows, pivot_spec, unit)
    searched = [r for r in ordered if r.searched]
    if searched:
        lines += max_len_section(searched, unit)
        lines += probe_sections(searched, unit)
    lines += environment_section(environments)
    lines += compile_notes(ordered) + plan_notes(ordered)
    lines += flag_footnotes(rows)
    return "\n".join(lines)


def report_row(row: RunRow) -> RunRow:
    """The row as report.md keeps it while it writes a large sweep: its ranks (~2.5 KB a run)
    dropped unless one holds what the report reads of a rank (report_runs: a peak below its
    inputs, the device's used bytes; report_environment.compile_notes: compilations). Every
    other figure of a rank is already the row's own (rank_peak_bytes, the slowest's times)."""
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


def row_order(row: RunRow) -> tuple[Any, ...]:
    """The report's row order: by label with its numbers read as numbers ("2,048" before
    "4,096"), then length, then run id."""
    return natural_key(row.label), row.length, row.run_id


def interval_line(rows: Sequence[RunRow]) -> list[str]:
    """What the report's time intervals cover, from the iterations that ran: the level is
    stated, never assumed to be 95%."""
    timed = [r for r in rows if r.median_s is not None]
    if not timed:
        return []
    counts = sorted({r.iterations for r in timed if r.iterations is not None})
    n = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"
    covers = levels(r.median_ci_level for r in timed)
    line = f"**Intervals**: the median intervals here cover {covers} ({n} iterations per run)."
    if any(r.median_ci_level is None or r.median_ci_level < CONFIDENCE for r in timed):
        line += (" Below 95% (fewer than 6 iterations) is too few iterations to tell a "
                 "change from noise: the compare page and `ringlab compare` say so rather "
                 "than calling a regression.")  # fmt: skip
    return [line, ""]


def _preamble(sweep: Sweep, rows: Sequence[RunRow], counts: dict[str, int]) -> list[str]:
    """The report's heading, its errors, the setup and protocol every run shares, what the
    figures mean, and the warnings (flagged results, runs timed beside others)."""
    created = sweep.created_at.strftime("%Y-%m-%d %H:%M")
    state = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no runs"
    lines = [
        f"# {sweep.name}",
        "",
        f"Sweep {sweep.id} · kind `{sweep.kind}` · created {created} UTC · "
        f"{len(rows)} runs: {state}",
        "",
    ]
    failed = [r for r in rows if r.error]
    if failed:
        lines += _errors(failed)
    for title, names in (("Setup", SETUP_FIELDS), ("Protocol", PROTOCOL_FIELDS)):
        shared = _fixed(rows, names)
        if shared:
            lines += [f"**{title}**: " + " · ".join(f"{k}={v}" for k, v in shared.items()), ""]
    lines += _kernels_as_run(rows)
    lines += [DEFINITIONS, "", *interval_line(rows)]
    flagged = [r for r in rows if r.flags]
    if flagged:
        lines += [
            f"**{len(flagged)} of {len(rows)} runs show a result above its physical limit** "
            "(marked ⚠, explained in the footnotes): read those numbers as suspect.",
            "",
        ]
    return lines + _cotenant_lines(rows)


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


def flag_footnotes(rows: Sequence[RunRow]) -> list[str]:
    """One footnote per flag code raised in these rows: what it means, then each run's own
    sentence (markdown footnotes; the ⚠[^code] marks point here)."""
    by_code: dict[str, list[str]] = {}
    for r in rows:
        for f in r.flags:
            by_code.setdefault(f.code, []).append(
                f"run {r.run_id} ({r.label}, seq {r.length:,}): {f.text}"
            )
    lines: list[str] = []
    for code, texts in by_code.items():
        lines.append(f"[^{code}]: {FLAG_TITLES.get(code, code)}")
        lines += [f"    - {t}" for t in texts]
        lines.append("")
    return lines


def _errors(failed: Sequence[RunRow]) -> list[str]:
    lines = ["## Errors", ""]
    for r in failed:
        text = (r.error or "").strip()
        first = text.splitlines()[0] if text else "-"
        lines.append(f"- run {r.run_id} ({r.label}, seq_len {r.seq_len:,}, {r.status}): {first}")
    return [*lines, ""]


def _cotenant_lines(rows: Sequence[RunRow]) -> list[str]:
    """A note naming the runs timed while other runs' gangs shared their nodes (their times
    may include contention for CPU, memory bandwidth or the link); none when each ran alone."""
    shared = sorted((r for r in rows if r.cotenants), key=lambda r: r.run_id)
    if not shared:
        return []
    named = "; ".join(
        f"run {r.run_id} beside {', '.join(str(c) for c in sorted(r.cotenants or []))}"
        for r in shared
    )
    return [
        f"**{len(shared)} of {len(rows)} runs were timed while other runs shared their nodes** "
        f"({named}): their times may include contention; `isolation: node` times a run alone.",
        "",
    ]
