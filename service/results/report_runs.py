"""report.md's tables of the runs themselves: results per run and length, forward and backward
apart, where a sequence-parallel run's time goes, maximum lengths and every search's probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.results.report_format import (
    FORMATS,
    fmt_bytes,
    fmt_latency,
    fmt_num,
    fmt_pct,
    fmt_rate,
    marks,
    ratio_cell,
    report_unit,
    table,
    table_head,
    table_line,
)
from service.results.rows import RunRow, local_tokens
from service.units import TimeUnit, time_unit


def _peak_headers(most: int) -> list[str]:
    """Per-rank peak column headers for runs of up to `most` ranks: one column per rank up to
    4 ranks, else one joined column."""
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


RATIO_COLUMNS = (
    ("Speedup", "speedup"),
    ("Memory ratio", "memory_ratio"),
    ("Max-length gain", "max_len_gain"),
    ("Scaling efficiency", "efficiency"),
)
"""(header, field) of the ratio columns a table shows where any of its runs has a value."""


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


@dataclass
class ResultsLayout:
    """The columns of a table of runs (results per run, maximum lengths): which optional
    columns any of its runs fills, found by add() over every run before a line is written, so
    a 100,000-run table is written a line at a time from a second read of its runs."""

    used: bool = False
    """Any run has a device's used bytes (CUDA): the Device used column."""
    most_ranks: int = 0
    ratio_fields: set[str] = field(default_factory=set)
    comm: bool = False
    """Any run has an exposed-communication share: its column, and the time's breakdown."""
    linked: bool = False
    """Any run probed its ring link: the time's breakdown."""

    def add(self, r: RunRow) -> None:
        self.used = self.used or _device_used(r) is not None
        self.most_ranks = max(self.most_ranks, len(r.rank_peak_bytes))
        self.ratio_fields.update(f for _, f in RATIO_COLUMNS if getattr(r, f) is not None)
        self.comm = self.comm or r.exposed_comm_share is not None
        self.linked = self.linked or r.link_probe_bytes_per_s is not None

    @classmethod
    def of(cls, rows: Sequence[RunRow]) -> ResultsLayout:
        layout = cls()
        for r in rows:
            layout.add(r)
        return layout

    @property
    def peaks(self) -> list[str]:
        return _peak_headers(self.most_ranks)

    @property
    def joined(self) -> bool:
        """The ranks' peaks in one column (over 4 ranks)."""
        return self.most_ranks > 4

    @property
    def ratios(self) -> list[tuple[str, str]]:
        return [(h, f) for h, f in RATIO_COLUMNS if f in self.ratio_fields]


def results_head(layout: ResultsLayout) -> list[str]:
    """The results table's heading and header: its lines follow (results_line)."""
    header = [
        "Run",
        "Seq len",
        "World",
        "Time",
        "p10 - p90",
        "Tokens/s",
        "TFLOP/s",
        *(["Exposed comm"] if layout.comm else []),
        "Memory after inputs",
        *(["Device used (CUDA)"] if layout.used else []),
        *_tail_header(layout.peaks, layout.ratios),
    ]
    return ["## Results per run and sequence length", "", *table_head(header)]


def results_line(r: RunRow, layout: ResultsLayout, unit: TimeUnit) -> str:
    """One run's line of the results table, in its layout's columns."""
    return table_line(
        [
            r.label,
            f"{r.length:,}",
            str(r.world_size),
            unit(r.median_s),
            f"{unit(r.p10_s)} - {unit(r.p90_s)}" if r.p10_s is not None else "-",
            fmt_num(r.tokens_per_s),
            fmt_num(r.tflops_per_s, 4),
            *([fmt_pct(r.exposed_comm_share)] if layout.comm else []),
            fmt_bytes(r.input_memory_bytes),
            *([fmt_bytes(_device_used(r))] if layout.used else []),
            *_tail_cells(r, len(layout.peaks), layout.joined, layout.ratios),
        ]
    )


def results_foot(layout: ResultsLayout, comm_lines: Sequence[str]) -> list[str]:
    """What follows the results table's lines: the memory figures' meaning (CUDA), then where
    a sequence-parallel run's time goes (comm_head, then comm_lines) when any run says."""
    lines = ["", *([DEVICE_USED, ""] if layout.used else [])]
    if layout.comm or layout.linked:
        lines += [*comm_head(), *comm_lines, ""]
    return lines


def phased(r: RunRow) -> bool:
    """Whether the run is in the forward and backward table (kernel cells in train mode)."""
    return r.forward_tflops_per_s is not None


PHASE_HEADER = ["Run", "Seq len", "World", "Forward", "p10 - p90", "Backward", "p10 - p90",
                "Forward+backward", "Forward TFLOP/s", "Backward TFLOP/s",
                "Total TFLOP/s"]  # fmt: skip


def phase_head() -> list[str]:
    """Kernel cells in train mode: forward and backward apart, as FlashAttention's and
    attention-gym's benchmarks report them (each phase's time and TFLOP/s, then the whole);
    the table's lines (phase_line) follow, then a blank line."""
    return [
        "## Forward and backward (train mode)",
        "",
        "The slowest rank's medians, each phase timed apart within every timed iteration (p10 - "
        "p90 of that rank beside them); forward+backward is the whole iteration (Time above). "
        "TFLOP/s = the kernel's own FLOPs summed over ranks / the phase's time: the forward's "
        "from kernel.flops(backward=False), the backward's = forward+backward's minus them.",
        "",
        *table_head(PHASE_HEADER),
    ]


def phase_line(r: RunRow, unit: TimeUnit) -> str:
    return table_line(
        [
            r.label, f"{r.length:,}", str(r.world_size),
            unit(r.forward_s), _spread(unit, r.forward_p10_s, r.forward_p90_s),
            unit(r.backward_s), _spread(unit, r.backward_p10_s, r.backward_p90_s),
            unit(r.median_s), fmt_num(r.forward_tflops_per_s, 4),
            fmt_num(r.backward_tflops_per_s, 4), fmt_num(r.tflops_per_s, 4),
        ]
    )  # fmt: skip


def _spread(unit: TimeUnit, lo: float | None, hi: float | None) -> str:
    """A p10 - p90 spread in `unit` ('-' when not measured)."""
    return "-" if lo is None or hi is None else f"{unit(lo)} - {unit(hi)}"


def in_comm_table(r: RunRow) -> bool:
    """Whether the run is in the time's breakdown: a sequence-parallel run with a measured
    exposed-communication share or ring link."""
    return r.exposed_comm_share is not None or r.link_probe_bytes_per_s is not None


def comm_line(r: RunRow) -> str:
    """One run's line of the time's breakdown (comm_head)."""
    return table_line(
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
    )


def comm_head() -> list[str]:
    """Where a sequence-parallel run's time goes (ring kernels, ulysses, allgather_kv): the
    seeds blame 'communication overhead' unmeasured. Its lines are comm_line's."""
    header = ["Run", "Seq len", "World", "Tokens per rank", "Exposed comm", "Link bandwidth",
              "Link latency", "Link", "Steps cover", "Crossover tokens",
              "Crossover from"]  # fmt: skip
    return [
        "## Where the time goes (sequence-parallel kernels)",
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
        *table_head(header),
    ]


def max_len_section(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
    layout = ResultsLayout.of(rows)
    peaks, joined, ratios = layout.peaks, layout.joined, layout.ratios
    unit = unit or report_unit(rows)
    body = (
        [
            r.label,
            str(r.world_size),
            fmt_num(r.max_seq_len) if r.max_seq_len else "none fit",
            unit(r.median_s),
            fmt_num(r.tokens_per_s),
            *_tail_cells(r, len(peaks), joined, ratios),
        ]
        for r in rows
    )
    header = [
        "Run",
        "World",
        "Max tokens",
        "Time at max",
        "Tokens/s at max",
        *_tail_header([f"{p} at max" for p in peaks], ratios),
    ]
    return ["## Maximum sequence length", "", *table(header, body), ""]


def probe_sections(rows: Sequence[RunRow], unit: TimeUnit | None = None) -> list[str]:
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
        lines += table(header, body)
        lines.append("")
    return lines if len(lines) > 2 else []
