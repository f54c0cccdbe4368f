"""report.md of a sweep's rows (service.results.rows, service.results.baselines): the tables a
researcher writes by hand today, with the formatting every page shares (fmt_*).

No number is computed here: every value is a field of the row; this module only picks and
formats them, so the report, the CSV and the dashboard cannot disagree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from service.db.models import Environment, Sweep
from service.results import baselines
from service.results.export import result_row
from service.results.plans import plan_notes
from service.results.rows import RunRow, local_tokens
from service.results.schemes import sp_schemes_section
from service.spec import PivotSpec, canonical_json
from service.units import MS, TimeUnit, levels, natural_key, time_unit
from service.units import nbytes as fmt_bytes  # binary units, '-' for none
from workers.noise import CONFIDENCE

# ---------------------------------------------------------------- formatting


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def fmt_num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


SPANS: dict[str, Callable[[float, float], str]] = {
    "speedup": lambda lo, hi: f"{lo:.2f}-{hi:.2f}",
    "efficiency": lambda lo, hi: f"{lo:.0%}-{hi:.0%}",
    "checkpoint_time_ratio": lambda lo, hi: f"{lo:.2f}-{hi:.2f}",
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


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in cells),
    ]


def _rank_peaks(rows: Sequence[RunRow]) -> list[str]:
    """Per-rank peak column headers: one column per rank up to 4 ranks, else one joined column."""
    most = max((len(r.rank_peak_bytes) for r in rows), default=0)
    if most <= 1:
        return ["Peak memory"]
    if most <= 4:
        return [f"Peak rank {i}" for i in range(most)]
    return ["Peak memory per rank"]


def _rank_peak_cells(r: RunRow, columns: int, joined: bool) -> list[str]:
    """Each rank's peak, marked where it is below that rank's inputs (peak_below_inputs)."""
    low = {v.rank for v in r.ranks if v.peak_below_inputs}
    mark = marks(r, "peak_memory_bytes")
    cells = [fmt_bytes(v) + (mark if i in low else "") for i, v in enumerate(r.rank_peak_bytes)]
    if joined:
        return [" / ".join(cells) or "-"]
    return [cells[i] if i < len(cells) else "-" for i in range(columns)]


def _tail_header(peaks: Sequence[str], ratios: Sequence[tuple[str, str]]) -> list[str]:
    """The columns the results and maximum-length tables end with."""
    return [
        *peaks,
        "Memory/token",
        *(["Baseline"] if ratios else []),
        *(h for h, _ in ratios),
        "Outcome",
    ]


def _tail_cells(
    r: RunRow, columns: int, joined: bool, ratios: Sequence[tuple[str, str]]
) -> list[str]:
    """One row's cells under _tail_header: per-rank peaks, memory per token, ratios, outcome."""
    return [
        *_rank_peak_cells(r, columns, joined),
        fmt_bytes(r.memory_per_token_bytes),
        *([r.baseline or "-"] if ratios else []),
        *(ratio_cell(r, f, FORMATS[f]) for _, f in ratios),
        r.outcome,
    ]


def _ratio_columns(rows: Sequence[RunRow]) -> list[tuple[str, str]]:
    """(header, field) of the ratio columns any of these rows has a value for."""
    wanted = [
        ("Speedup", "speedup"),
        ("Memory ratio", "memory_ratio"),
        ("Max-length gain", "max_len_gain"),
        ("Scaling efficiency", "efficiency"),
    ]
    return [(h, f) for h, f in wanted if any(getattr(r, f) is not None for r in rows)]


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
        lines += _results_section(bench, unit)
        lines += _phase_section(bench, unit)
    lines += _baseline_section(ordered, unit)
    lines += sp_schemes_section([result_row(r) for r in ordered])
    models = [r for r in ordered if r.workload == "model"]
    if models:
        lines += model_sections(models, unit)
    if pivot_spec is not None:
        lines += _pivot_section(rows, pivot_spec, unit)
    searched = [r for r in ordered if r.searched]
    if searched:
        lines += _max_len_section(searched, unit)
        lines += _probe_sections(searched, unit)
    lines += _environment_section(environments)
    lines += compile_notes(ordered) + plan_notes(ordered)
    lines += flag_footnotes(rows)
    return "\n".join(lines)


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


def report_unit(rows: Sequence[RunRow]) -> TimeUnit:
    """The one time unit of every table of the report, from all its runs' medians: a run's
    time reads the same in each table (not "1.45 s" in one and "1,446.6 ms" in the next)."""
    return time_unit(r.median_s for r in rows)


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
"""The footnote each flag code opens with (service.results.baselines and service.results.rows
raise them)."""


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


DEVICE_USED = (
    "Peak memory is the allocator's (CUDA: torch.cuda.max_memory_allocated above the rank's "
    "baseline); Device used (CUDA) is the largest rank's growth in the device's used bytes "
    "(cudaMemGetInfo, device-wide) from that baseline to the end of its timed iterations, "
    "NCCL's buffers, cuBLAS/cuDNN workspaces and the allocator's cached blocks included."
)
"""What the two memory figures of a CUDA run are, said under the table that shows both."""


def _device_used(r: RunRow) -> int | None:
    """CUDA: the largest device_used_bytes over the run's ranks; None where none has one."""
    used = [v.device_used_bytes for v in r.ranks if v.device_used_bytes is not None]
    return max(used) if used else None


def _results_section(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
    used = any(_device_used(r) is not None for r in rows)
    peaks = _rank_peaks(rows)
    joined = peaks == ["Peak memory per rank"]
    ratios = _ratio_columns(rows)
    comm = any(r.exposed_comm_share is not None for r in rows)
    unit = unit or report_unit(rows)
    body = []
    for r in rows:
        body.append(
            [
                r.label,
                f"{r.length:,}",
                str(r.world_size),
                unit(r.median_s),
                f"{unit(r.p10_s)} - {unit(r.p90_s)}" if r.p10_s is not None else "-",
                fmt_num(r.tokens_per_s),
                fmt_num(r.tflops_per_s, 4),
                *([fmt_pct(r.exposed_comm_share)] if comm else []),
                fmt_bytes(r.input_memory_bytes),
                *([fmt_bytes(_device_used(r))] if used else []),
                *_tail_cells(r, len(peaks), joined, ratios),
            ]
        )
    header = [
        "Run",
        "Seq len",
        "World",
        "Time",
        "p10 - p90",
        "Tokens/s",
        "TFLOP/s",
        *(["Exposed comm"] if comm else []),
        "Memory after inputs",
        *(["Device used (CUDA)"] if used else []),
        *_tail_header(peaks, ratios),
    ]
    lines = ["## Results per run and sequence length", "", *_table(header, body), ""]
    lines += [DEVICE_USED, ""] if used else []
    linked = any(r.link_probe_bytes_per_s is not None for r in rows)
    return lines + (_comm_section(rows) if comm or linked else [])


def fmt_rate(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{fmt_bytes(bytes_per_s)}/s"


def fmt_latency(seconds: float | None) -> str:
    """A latency in microseconds (`-` when none was measured)."""
    return "-" if seconds is None else f"{seconds * 1e6:,.0f} us"


def _phase_section(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
    """Kernel cells in train mode: forward and backward apart, as FlashAttention's and
    attention-gym's benchmarks report them (each phase's time and TFLOP/s, then the whole)."""
    phased = [r for r in rows if r.forward_tflops_per_s is not None]
    if not phased:
        return []
    unit = unit or time_unit(t for r in phased for t in (r.forward_s, r.backward_s, r.median_s))
    body = [
        [
            r.label, f"{r.length:,}", str(r.world_size),
            unit(r.forward_s), _spread(unit, r.forward_p10_s, r.forward_p90_s),
            unit(r.backward_s), _spread(unit, r.backward_p10_s, r.backward_p90_s),
            unit(r.median_s), fmt_num(r.forward_tflops_per_s, 4),
            fmt_num(r.backward_tflops_per_s, 4), fmt_num(r.tflops_per_s, 4),
        ]
        for r in phased
    ]  # fmt: skip
    header = ["Run", "Seq len", "World", "Forward", "p10 - p90", "Backward", "p10 - p90",
              "Forward+backward", "Forward TFLOP/s", "Backward TFLOP/s",
              "Total TFLOP/s"]  # fmt: skip
    return [
        "## Forward and backward (train mode)",
        "",
        "The slowest rank's medians, each phase timed apart within every timed iteration (p10 - "
        "p90 of that rank beside them); forward+backward is the whole iteration (Time above). "
        "TFLOP/s = the kernel's own FLOPs summed over ranks / the phase's time: the forward's "
        "from kernel.flops(backward=False), the backward's = forward+backward's minus them.",
        "",
        *_table(header, body),
        "",
    ]


def _spread(unit: TimeUnit, lo: float | None, hi: float | None) -> str:
    """A p10 - p90 spread in `unit` ('-' when not measured)."""
    return "-" if lo is None or hi is None else f"{unit(lo)} - {unit(hi)}"


def _comm_section(rows: Sequence[RunRow]) -> list[str]:
    """Where a ring run's time goes: the seeds blame 'communication overhead' unmeasured."""
    ring = [
        r for r in rows if r.exposed_comm_share is not None or r.link_probe_bytes_per_s is not None
    ]
    body = [
        [
            r.label,
            f"{r.length:,}",
            str(r.world_size),
            fmt_num(local_tokens(r.parallel, r.world_size, r.batch_size, r.length)),
            fmt_pct(r.exposed_comm_share),
            fmt_rate(r.link_probe_bytes_per_s),
            fmt_latency(r.link_latency_s),
            r.link_kind or "-",
            fmt_pct(r.step_coverage),
            fmt_num(r.crossover_tokens),
            r.crossover_basis or "-",
        ]
        for r in ring
    ]
    header = ["Run", "Seq len", "World", "Tokens per rank", "Exposed comm", "Link bandwidth",
              "Link latency", "Link", "Steps cover", "Crossover tokens",
              "Crossover from"]  # fmt: skip
    return [
        "## Where the time goes (ring kernels)",
        "",
        "Exposed comm = time every rank spent blocked on a transfer / its time in ring steps "
        "(compute + wait), over all timed iterations. Link bandwidth and latency = the ring "
        "link measured before the timed loop: each rank pings one K/V block (and a 4-byte "
        "message) to its next ring rank and back, alone; bandwidth = the block's bytes / "
        "one-way time (the fastest timed round trip / 2), the slowest rank's; latency the "
        "largest. Link = what that link was "
        "(loopback on one host is no network). Steps cover = the smallest share of a rank's "
        "iteration time its steps account for. Crossover (ring only) = the tokens per rank at "
        "which a step's compute would take as long as its transfer (F/B): F the rate the "
        "steps computed at, B the link bandwidth.",
        "",
        *_table(header, body),
        "",
    ]


def _baseline_section(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
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
    body = [
        [r.label, f"{r.length:,}", r.baseline or "-", time_cell(b, unit), time_cell(r, unit),
         ratio_cell(r, "speedup", fmt_x),
         fmt_bytes(b.peak_memory_bytes) + marks(b, "peak_memory_bytes"),
         fmt_bytes(r.peak_memory_bytes) + marks(r, "peak_memory_bytes"),
         fmt_x(r.memory_ratio), ratio_cell(r, "efficiency", fmt_pct)]
        for r, b in pairs
    ]  # fmt: skip
    header = ["Run", "Seq len", "Baseline", f"Baseline time (interval, {unit.name})",
              f"Time (interval, {unit.name})", "Speedup", "Baseline peak", "Peak",
              "Memory ratio", "Scaling efficiency"]  # fmt: skip
    return ["## Against the baseline", "", *_table(header, body), ""]


def _max_len_against_baseline(pairs: Sequence[tuple[RunRow, RunRow]]) -> list[str]:
    """(run, its baseline) of searches: both maximum lengths and tokens/s at them, the gain,
    speedup and scaling efficiency."""
    body = [
        [r.label, r.baseline or "-", fmt_num(b.max_seq_len), fmt_num(r.max_seq_len),
         fmt_x(r.max_len_gain), fmt_num(b.tokens_per_s), fmt_num(r.tokens_per_s),
         ratio_cell(r, "speedup", fmt_x), ratio_cell(r, "efficiency", fmt_pct)]
        for r, b in pairs
    ]  # fmt: skip
    header = ["Run", "Baseline", "Baseline max tokens", "Max tokens", "Max-length gain",
              "Baseline tokens/s at max", "Tokens/s at max", "Speedup",
              "Scaling efficiency"]  # fmt: skip
    return ["## Maximum length against the baseline", "", *_table(header, body), ""]


def _pivot_section(
    rows: Sequence[RunRow], spec: PivotSpec, unit: TimeUnit | None = None
) -> list[str]:
    """The pivot: a table per section (what else varies, in its heading), the same columns in
    each, so a column is one kind of run all the way down; times in one unit for all of them."""
    table = baselines.pivot(rows, spec)
    if not table.columns or not table.sections:
        return []
    show = FORMATS[spec.value]
    if spec.value == "median_s":
        show = unit or time_unit(v for _, values in table.rows for v in values)
    title = baselines.PIVOT_VALUES[spec.value]
    lines = [
        f"## {title[0].upper() + title[1:]} by {table.row_header} and {table.column_header}",
        "",
    ]
    if spec.value in SPANS:
        lines += [
            "Each ratio's interval and whether it is within noise: see Against the baseline.",
            "",
        ]
    header = [table.row_header[0].upper() + table.row_header[1:], *table.columns]
    for section in table.sections:
        body = [
            [name, *(show(v) + _flag_marks(section.flags.get((i, j), [])) for j, v in
                     enumerate(values))]
            for i, (name, values) in enumerate(section.rows)
        ]  # fmt: skip
        lines += [f"### {section.title}", ""] if section.title else []
        lines += [*_table(header, body), ""]
    return lines


def _flag_marks(codes: Sequence[str]) -> str:
    return "".join(f" ⚠[^{code}]" for code in codes)


def _max_len_section(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
    peaks = _rank_peaks(rows)
    joined = peaks == ["Peak memory per rank"]
    ratios = _ratio_columns(rows)
    unit = unit or report_unit(rows)
    body = []
    for r in rows:
        body.append(
            [
                r.label,
                str(r.world_size),
                fmt_num(r.max_seq_len) if r.max_seq_len else "none fit",
                unit(r.median_s),
                fmt_num(r.tokens_per_s),
                *_tail_cells(r, len(peaks), joined, ratios),
            ]
        )
    header = [
        "Run",
        "World",
        "Max tokens",
        "Time at max",
        "Tokens/s at max",
        *_tail_header([f"{p} at max" for p in peaks], ratios),
    ]
    return ["## Maximum sequence length", "", *_table(header, body), ""]


def _probe_sections(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
    """Every probe of every search: the seed's 'length | memory | result | notes' tables."""
    lines = ["## Probes of each search", ""]
    for r in rows:
        if not r.probes:
            continue
        most = max(len(p.rank_peak_bytes) for p in r.probes)
        peaks = [f"Peak rank {i}" for i in range(most)] if most > 1 else ["Peak memory"]
        shown = unit or time_unit(p.time_s for p in r.probes)
        body = []
        for p in sorted(r.probes, key=lambda p: p.seq_len):
            per_rank = p.rank_peak_bytes if most > 1 else [p.peak_memory_bytes]
            note = ""
            if p.outcome == "oom":
                note = (
                    f"tried to allocate {fmt_bytes(p.requested_bytes)}"
                    if p.requested_bytes is not None
                    else ""
                )
                note += " (emulated budget)" if p.emulated else ""
            elif p.outcome == "error":
                note = (p.error or "").splitlines()[0] if p.error else ""
            body.append(
                [
                    f"{p.seq_len:,}",
                    shown(p.time_s),
                    fmt_bytes(p.input_memory_bytes),
                    *(fmt_bytes(v) for v in (list(per_rank) + [None] * most)[: len(peaks)]),
                    {"fit": "fit", "oom": "OOM", "error": "error"}[p.outcome],
                    note.strip() or "-",
                ]
            )
        lines += [f"### Run {r.run_id}: {r.label}", ""]
        header = ["Seq len", "Time", "Memory after inputs", *peaks, "Result", "Notes"]
        lines += _table(header, body)
        lines.append("")
    return lines if len(lines) > 2 else []


def _gpu(g: Any) -> str:
    if isinstance(g, dict):
        name = g.get("name", "?")
        mem = g.get("memory_bytes") or g.get("total_memory")
        return f"{name} ({fmt_bytes(mem)})" if isinstance(mem, int) else str(name)
    return str(g)


def _host(h: Any) -> str:
    if isinstance(h, dict):
        return str(h.get("hostname") or h.get("ip") or json.dumps(h, sort_keys=True))
    return str(h)


def _plugin_code(code: dict[str, Any] | None) -> str:
    """'package sha (dirty)' of each plugin installed from a checkout, '-' when none."""
    parts = [
        f"{package} {c.get('git_sha')}" + (" (dirty)" if c.get("git_dirty") else "")
        for package, c in (code or {}).items()
    ]
    return ", ".join(parts) or "-"


def _cpu(model: str | None, cores: int | None) -> str:
    """'model (N logical CPUs)', '-' when neither was recorded."""
    if model is None and cores is None:
        return "-"
    return f"{model or 'unknown CPU'}" + (f" ({cores} logical CPUs)" if cores else "")


def _environment_section(environments: Sequence[Environment]) -> list[str]:
    if not environments:
        return []
    rows = [
        [
            str(e.id),
            ", ".join(_host(h) for h in e.hosts) or "-",
            ", ".join(_gpu(g) for g in e.gpus) or "none (CPU)",
            e.driver or "-",
            e.torch,
            e.cuda or "-",
            e.nccl or "-",
            e.ray or "-",
            e.python,
            _cpu(e.cpu_model, e.cpu_cores),
            str(e.cpu_threads or "-"),
            (e.git_sha or "-") + (" (dirty)" if e.git_dirty else ""),
            _plugin_code(e.plugin_code),
        ]
        for e in environments
    ]
    header = ["Env", "Hosts", "GPUs", "Driver", "torch", "CUDA", "NCCL", "Ray", "Python"]
    header += ["CPU", "CPU threads", "git", "plugin code"]
    return ["## Environment", "", *_table(header, rows), ""]


def compile_notes(rows: Sequence[RunRow]) -> list[str]:
    """The environment notes' compilation line: each run that compiled (torch.compile), its
    graphs and seconds on the rank that spent longest, as Dynamo counted them; nothing when no
    run recorded a compilation."""
    noted = []
    for row in rows:
        ranks = [r for r in row.ranks if r.compilations and r.compile_s is not None]
        if not ranks:
            continue
        worst = max(ranks, key=lambda r: r.compile_s or 0.0)
        noted.append(
            f"run {row.run_id} ({row.label}, {row.length:,}, {row.mode}): "
            f"{worst.compilations} graph{'s' if worst.compilations != 1 else ''} in "
            f"{worst.compile_s:.1f} s"
        )
    if not noted:
        return []
    return [
        "**Compilation** (torch.compile, Dynamo's own count and seconds, on the rank that "
        "spent longest; in the correctness gate and the warm-up at the run's own length, "
        "never in a timed iteration): " + " · ".join(noted),
        "",
    ]


# ---------------------------------------------------------------- training memory (seed 004)

COMPONENT_TITLES = {
    "parameters": "Parameters",
    "gradients": "Gradients",
    "optimizer_states": "Optimizer states",
    "optimizer_state_tensors": "Optimizer states (bytes in optimizer.state)",
    "activations": "Activations saved for backward",
    "forward_transient": "Forward transient peak",
    "backward_peak": "Backward peak",
    "step_peak": "Step peak",
    "allocator_overhead": "Allocator overhead (reserved - allocated)",
}
"""How the report and the dashboard name each memory component."""


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def model_sections(rows: Sequence[RunRow], unit: TimeUnit = MS) -> list[str]:
    """Seed 004's tables: training memory per model cell (max tokens found and predicted,
    fixed memory, memory per token, against the baseline), memory per component predicted
    and measured, and the step time by phase with the cost of checkpointing."""
    return [*_training_memory(rows), *_component_table(rows), *_step_time_table(rows, unit)]


TRAINING_MEMORY_HEADER = [
    "Model", "d × heads × layers", "Optimizer", "Precision", "Checkpointing", "Tokens measured",
    "Max tokens found", "Max tokens predicted", "Fixed", "KB per token", "Step peak",
    "Step peak predicted",
]  # fmt: skip
"""The training memory table's columns but its last (the gain against the baseline)."""


def _training_memory(rows: Sequence[RunRow]) -> list[str]:
    """One line per model cell: its setup, the tokens found and predicted, fixed memory,
    memory per token and the step peak, and its gain against the baseline run named."""
    searched = any(r.searched for r in rows)
    gain_title = "Max-length gain" if searched else "Memory ratio"
    body = [_training_memory_cells(r) for r in rows]
    return [
        "## Training memory",
        "",
        "Per model cell, on its limiting rank: fixed = parameters + gradients + optimizer "
        "states (measured); KB per token = (step peak - fixed) / tokens the rank holds; "
        "predicted values come from the cell alone (workers/model_memory.py) before it ran; "
        "the last column compares with the baseline run named (see Against the baseline).",
        "",
        *_table([*TRAINING_MEMORY_HEADER, gain_title], body),
        "",
    ]


def _training_memory_cells(r: RunRow) -> list[str]:
    """One model cell's line of the training memory table."""
    found = r.max_seq_len if r.searched else None
    gain = r.max_len_gain if r.searched else r.memory_ratio
    chunk = (r.config.get("training") or {}).get("loss_chunk_tokens")
    checkpointing = r.checkpointing or "-"
    if chunk is not None:
        checkpointing += f" · loss in chunks of {chunk:,}"
    return [
        r.model or "-", r.model_shape or "-", r.optimizer or "-", r.precision or "-",
        checkpointing, fmt_num(r.measured_seq_len), fmt_num(found),
        fmt_num(r.predicted_max_seq_len), fmt_bytes(r.fixed_bytes),
        "-" if r.bytes_per_token is None else f"{r.bytes_per_token / 1e3:,.1f}",
        fmt_bytes(r.peak_memory_bytes), fmt_bytes(r.predicted_peak_bytes),
        f"{fmt_x(gain)} vs run {r.baseline_run_id}" if gain is not None else "-",
    ]  # fmt: skip


def _component_table(rows: Sequence[RunRow]) -> list[str]:
    """Every model cell's memory components (its limiting rank), predicted and measured."""
    lines = ["### Memory per component, predicted and measured", ""]
    body = [
        [r.label, f"{r.length:,}", str(c.rank), COMPONENT_TITLES.get(c.component, c.component),
         fmt_bytes(c.predicted_bytes), fmt_bytes(c.measured_bytes), fmt_ratio(c.ratio)]
        for r in rows
        for c in r.components
    ]  # fmt: skip
    if not body:
        return [*lines, "No model run has stored its components yet.", ""]
    header = ["Run", "Tokens", "Rank", "Component", "Predicted", "Measured",
              "Measured / predicted"]  # fmt: skip
    return [*lines, *_table(header, body), ""]


def _step_time_table(rows: Sequence[RunRow], unit: TimeUnit = MS) -> list[str]:
    """Each timed model cell's step by phase, its MFU and the cost of checkpointing."""
    timed = [r for r in rows if r.median_s is not None]
    if not timed:
        return []
    body = [
        [r.label, f"{r.length:,}", unit(r.forward_s), unit(r.backward_s),
         unit(r.optimizer_s), unit(r.median_s), fmt_num(r.tokens_per_s),
         fmt_pct(r.peak_fraction), ratio_cell(r, "checkpoint_time_ratio", fmt_x)]
        for r in timed
    ]  # fmt: skip
    header = ["Run", "Tokens", "Forward", "Backward", "Optimizer", "Step", "Tokens/s", "MFU",
              "Checkpointing cost"]  # fmt: skip
    return [
        "### Step time by phase",
        "",
        "The slowest rank's medians; MFU = model FLOP/s per rank (6 x parameters per token "
        "plus the kernel's attention FLOPs) / the device's dense peak; checkpointing cost "
        "= step time / the same cell's without checkpointing.",
        "",
        *_table(header, body),
        "",
    ]
