"""Headline metrics per run and the exports built from them: CSV, JSON rows, a markdown report.

Headline conventions (documented in the report): time is the slowest rank's median, tokens/s is
batch_size * seq_len over that time, TFLOP/s is FLOPs summed over ranks over that time, peak
memory is the largest over the ranks; a max_seq_len run's answer is its longest probe that fit.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from service.api.schemas import Headline
from service.db.models import Environment, Probe, ProbeOutcome, RankResult, Run, Sweep
from service.spec import canonical_json

CSV_COLUMNS = (
    "run_id",
    "sweep_id",
    "kernel",
    "params",
    "seq_len",
    "world_size",
    "batch_size",
    "num_heads",
    "head_dim",
    "dtype",
    "causal",
    "mode",
    "parallel",
    "status",
    "outcome",
    "attempts",
    "median_s",
    "tokens_per_s",
    "tflops_per_s",
    "peak_memory_bytes",
    "max_seq_len",
    "backend",
    "max_abs_error",
    "environment_id",
    "error",
)


def headline(run: Run, ranks: Sequence[RankResult], probes: Sequence[Probe]) -> Headline:
    """The numbers a table shows for one run (None where nothing was measured)."""
    fits = [p for p in probes if p.outcome == ProbeOutcome.fit]
    max_len = max((p.seq_len for p in fits), default=None)
    if not ranks:
        return Headline(
            median_s=None,
            tokens_per_s=None,
            tflops_per_s=None,
            peak_memory_bytes=None,
            max_seq_len=max_len,
        )
    median = max(r.median_s for r in ranks)
    tokens = run.config.get("batch_size", 1) * run.seq_len
    return Headline(
        median_s=median,
        tokens_per_s=tokens / median if median > 0 else None,
        tflops_per_s=sum(r.flops for r in ranks) / median / 1e12 if median > 0 else None,
        peak_memory_bytes=max(r.peak_memory_bytes for r in ranks),
        max_seq_len=max_len,
    )


def result_row(run: Run, ranks: Sequence[RankResult], probes: Sequence[Probe]) -> dict[str, Any]:
    """One flat row per run: its cell, outcome and headline numbers."""
    h = headline(run, ranks, probes)
    cfg = run.config
    errors = [r.max_abs_error for r in ranks if r.max_abs_error is not None]
    return {
        "run_id": run.id,
        "sweep_id": run.sweep_id,
        "kernel": run.kernel,
        "params": canonical_json(cfg.get("params", {})),
        "seq_len": run.seq_len,
        "world_size": run.world_size,
        "batch_size": cfg.get("batch_size"),
        "num_heads": cfg.get("num_heads"),
        "head_dim": cfg.get("head_dim"),
        "dtype": run.dtype,
        "causal": run.causal,
        "mode": run.mode,
        "parallel": cfg.get("parallel"),
        "status": str(run.status),
        "outcome": outcome(run, ranks),
        "attempts": run.attempts,
        "median_s": h.median_s,
        "tokens_per_s": h.tokens_per_s,
        "tflops_per_s": h.tflops_per_s,
        "peak_memory_bytes": h.peak_memory_bytes,
        "max_seq_len": h.max_seq_len,
        "backend": ",".join(sorted({r.backend for r in ranks})) or None,
        "max_abs_error": max(errors) if errors else None,
        "environment_id": run.environment_id,
        "error": run.error,
    }


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """CSV with a header row; empty cells for missing values."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})
    return buf.getvalue()


# ---------------------------------------------------------------- markdown report

SETUP_FIELDS = ("batch_size", "num_heads", "head_dim", "dtype", "causal", "mode", "parallel")
"""Config fields shown once under Setup when every run shares them, else as table columns."""
PROTOCOL_FIELDS = ("device", "warmup", "iterations", "placement", "fresh_processes")


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _params(run: Run) -> str:
    """The kernel's parameters that are set (unset ones mean the kernel's own choice)."""
    params = run.config.get("params") or {}
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items()) if v is not None) or "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in cells),
    ]


def local_tokens(config: dict[str, Any], seq_len: int) -> int:
    """Tokens one rank holds: the batch splits under parallel=data, the sequence otherwise."""
    world = max(int(config.get("world_size", 1)), 1)
    batch = int(config.get("batch_size", 1))
    if config.get("parallel") == "data":
        return max(batch // world, 1) * seq_len
    return batch * max(seq_len // world, 1)


def _per_token(peak: int | None, config: dict[str, Any], seq_len: int) -> str:
    return "-" if peak is None else _bytes(peak / local_tokens(config, seq_len))


def outcome(run: Run, ranks: Sequence[RankResult]) -> str:
    """A short outcome label: ok (with the correctness error when checked), OOM, failed, ..."""
    status = str(run.status)
    if status == "succeeded":
        errors = [r.max_abs_error for r in ranks if r.max_abs_error is not None]
        return f"ok (max abs err {max(errors):.1e})" if errors else "ok"
    return {"oom": "OOM", "timed_out": "timed out"}.get(status, status)


def _varying(runs: Sequence[Run], fields: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Fields whose value differs between runs, and the shared value of the others."""
    varying, fixed = [], {}
    for field in fields:
        values = {canonical_json(r.config.get(field)) for r in runs}
        if len(values) > 1:
            varying.append(field)
        elif runs:
            fixed[field] = runs[0].config.get(field)
    return varying, fixed


def _scaling_key(run: Run) -> str:
    cfg = {k: v for k, v in run.config.items() if k not in ("world_size", "seed")}
    return canonical_json(cfg)


def report_markdown(
    sweep: Sweep,
    runs: Sequence[Run],
    ranks: dict[int, list[RankResult]],
    probes: dict[int, list[Probe]],
    environments: Sequence[Environment],
    counts: dict[str, int],
) -> str:
    """A markdown report of a sweep in the style of the reports users write by hand."""
    heads = {r.id: headline(r, ranks.get(r.id, []), probes.get(r.id, [])) for r in runs}
    order = sorted(runs, key=lambda r: (r.kernel, _params(r), r.seq_len, r.world_size, r.id))
    varying, fixed = _varying(runs, SETUP_FIELDS)
    _, protocol = _varying(runs, PROTOCOL_FIELDS)
    created = sweep.created_at.strftime("%Y-%m-%d %H:%M")
    state = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no runs"
    lines = [
        f"# {sweep.name}",
        "",
        f"Sweep {sweep.id} · kind `{sweep.kind}` · created {created} UTC · "
        f"{len(runs)} runs: {state}",
        "",
    ]
    if fixed:
        setup = " · ".join(f"{k}={v}" for k, v in fixed.items())
        lines += [f"**Setup**: {setup}", ""]
    if protocol:
        lines += ["**Protocol**: " + " · ".join(f"{k}={v}" for k, v in protocol.items()), ""]
    lines += [
        "Time is the slowest rank's median per iteration (p10-p90 of that rank beside it); "
        "tokens/s = batch_size x seq_len / time; TFLOP/s = FLOPs summed over ranks / time "
        "(attention FLOPs 4·b·s·s·h·d, halved for causal, x3.5 for forward+backward, only "
        "computed blocks for sparse kernels); peak memory is each rank's own, reset for this "
        "case; memory/token divides the largest rank peak by the tokens that rank holds.",
        "",
    ]
    extra = [f.replace("_", " ") for f in varying]

    bench = [r for r in order if r.config.get("search") is None]
    if bench:
        rows = []
        for r in bench:
            h, rr = heads[r.id], ranks.get(r.id, [])
            slow = max(rr, key=lambda x: x.median_s) if rr else None
            rows.append(
                [
                    r.kernel,
                    _params(r),
                    *(str(r.config.get(f)) for f in varying),
                    f"{r.seq_len:,}",
                    str(r.world_size),
                    _ms(h.median_s),
                    f"{_ms(slow.p10_s)} - {_ms(slow.p90_s)}" if slow else "-",
                    _num(h.tokens_per_s),
                    _num(h.tflops_per_s, 4),
                    " / ".join(_bytes(x.peak_memory_bytes) for x in rr) or "-",
                    _per_token(h.peak_memory_bytes, r.config, r.seq_len),
                    outcome(r, rr),
                ]
            )
        lines += ["## Results per kernel and sequence length", ""]
        lines += _table(
            [
                "Kernel",
                "Params",
                *extra,
                "Seq len",
                "World",
                "Time",
                "p10 - p90",
                "Tokens/s",
                "TFLOP/s",
                "Peak memory per rank",
                "Memory/token",
                "Outcome",
            ],
            rows,
        )
        lines.append("")

    searched = [r for r in order if r.config.get("search") is not None]
    if searched:
        rows = []
        for r in sorted(searched, key=lambda r: (r.kernel, _params(r), r.world_size, r.id)):
            best = heads[r.id].max_seq_len
            tried = sorted(probes.get(r.id, []), key=lambda p: p.seq_len)
            at_best = next((p for p in tried if p.seq_len == best), None)
            peak = at_best.peak_memory_bytes if at_best else None
            listed = "; ".join(
                f"{p.seq_len:,} {p.outcome}{' (emulated)' if p.emulated else ''}"
                + (f" {_bytes(p.peak_memory_bytes)}" if p.peak_memory_bytes is not None else "")
                for p in tried
            )
            rows.append(
                [
                    r.kernel,
                    _params(r),
                    *(str(r.config.get(f)) for f in varying),
                    str(r.world_size),
                    "-" if best is None else f"{best:,}",
                    _bytes(peak),
                    _per_token(peak, r.config, best) if best else "-",
                    listed or "-",
                    outcome(r, ranks.get(r.id, [])),
                ]
            )
        lines += ["## Maximum sequence length per kernel and world size", ""]
        lines += _table(
            [
                "Kernel",
                "Params",
                *extra,
                "World",
                "Max tokens",
                "Peak memory at max",
                "Memory/token",
                "Probes (length outcome peak)",
                "Outcome",
            ],
            rows,
        )
        lines.append("")

    lines += _scaling_section(order, heads)
    lines += _environment_section(environments)

    failed = [r for r in order if r.error]
    if failed:
        lines += ["## Errors", ""]
        for r in failed:
            first = (r.error or "").strip().splitlines()[0] if (r.error or "").strip() else "-"
            lines.append(
                f"- run {r.id} ({r.kernel}, seq_len {r.seq_len:,}, world {r.world_size}, "
                f"{r.status}): {first}"
            )
        lines.append("")
    return "\n".join(lines)


def _gpu(g: Any) -> str:
    if isinstance(g, dict):
        name = g.get("name", "?")
        mem = g.get("memory_bytes") or g.get("total_memory")
        return f"{name} ({_bytes(mem)})" if isinstance(mem, int) else str(name)
    return str(g)


def _host(h: Any) -> str:
    if isinstance(h, dict):
        return str(h.get("hostname") or h.get("ip") or h)
    return str(h)


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
            (e.git_sha or "-") + (" (dirty)" if e.git_dirty else ""),
        ]
        for e in environments
    ]
    header = ["Env", "Hosts", "GPUs", "Driver", "torch", "CUDA", "NCCL", "Ray", "Python", "git"]
    return ["## Environment", "", *_table(header, rows), ""]


def _scaling_section(runs: Sequence[Run], heads: dict[int, Headline]) -> list[str]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        h = heads[r.id]
        if str(r.status) == "succeeded" and (h.median_s or h.max_seq_len):
            groups[_scaling_key(r)].append(r)
    rows = []
    for group in groups.values():
        if len({r.world_size for r in group}) < 2:
            continue
        group.sort(key=lambda r: r.world_size)
        base = group[0]
        for r in group:
            hb, h = heads[base.id], heads[r.id]
            factor = r.world_size / base.world_size
            searched = r.config.get("search") is not None
            if searched and h.max_seq_len and hb.max_seq_len:
                gain = h.max_seq_len / hb.max_seq_len
                metric = f"max tokens {h.max_seq_len:,}"
            elif not searched and h.median_s and hb.median_s:
                gain = hb.median_s / h.median_s
                metric = f"time {_ms(h.median_s)}"
            else:
                continue
            rows.append(
                [
                    r.kernel,
                    _params(r),
                    str(r.config.get("parallel")),
                    "search" if searched else f"{r.seq_len:,}",
                    str(r.world_size),
                    metric,
                    f"{gain:.2f}x",
                    f"{gain / factor:.0%}",
                ]
            )
    if not rows:
        return []
    header = ["Kernel", "Params", "Parallel", "Seq len", "World", "Measured", "Gain", "Efficiency"]
    return [
        "## Scaling with world size",
        "",
        "Gain over the smallest world size of the same configuration (speed-up for timed runs, "
        "longer maximum for searches); efficiency = gain / world size ratio.",
        "",
        *_table(header, rows),
        "",
    ]
