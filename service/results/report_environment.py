"""report.md's environment: the table of every environment the runs ran in, and the note of
each run that compiled (torch.compile).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from service.db.models import Environment
from service.results.report_format import fmt_bytes, table
from service.results.rows import RunRow
from service.units import rate


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


def _matmul(e: Environment) -> str:
    """The node's measured matmul rate, its dtype and the product's side: '21.5 GFLOP/s
    (float32, n=1,024)'; '-' for environments stored before the probe."""
    if e.matmul_flops_per_s is None:
        return "-"
    shown = rate(e.matmul_flops_per_s, "matmul_flops_per_s")
    return f"{shown} ({e.matmul_dtype}, n={e.matmul_size:,})"


def environment_section(environments: Sequence[Environment]) -> list[str]:
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
            _matmul(e),
            (e.git_sha or "-") + (" (dirty)" if e.git_dirty else ""),
            _plugin_code(e.plugin_code),
        ]
        for e in environments
    ]
    header = ["Env", "Hosts", "GPUs", "Driver", "torch", "CUDA", "NCCL", "Ray", "Python"]
    header += ["CPU", "CPU threads", "matmul", "git", "plugin code"]
    return ["## Environment", "", *table(header, rows), ""]


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
