"""`ringlab export SWEEP --to mlflow|wandb|tensorboard`: a sweep's runs written where researchers
already keep experiments, through each tool's own client library (optional extras:
ringlab[mlflow], ringlab[wandb], ringlab[tensorboard]).

Every exporter writes the same records, read from the service's API (the one read model,
service.results.rows): one per run, with the cell as params, the run's numbers as metrics (per rank
with the rank as the step), the environment and code version as tags, report.md attached (and,
in MLflow and W&B, the run's kept artifacts: profiler traces, memory snapshots). Each run is
found again by its tags or its deterministic id, so exporting again updates what is there and
never duplicates it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.results.rows import NOT_MEASURED_FIELDS

METRICS = {
    "median_s": "time_median_s",
    "median_lo_s": "time_median_lo_s",
    "median_hi_s": "time_median_hi_s",
    "median_ci_level": "time_median_ci_level",
    "iterations": "iterations",
    "tokens_per_s": "tokens_per_s",
    "tflops_per_s": "tflops_per_s",
    "peak_memory_bytes": "peak_memory_bytes",
    "max_abs_error": "gate_max_abs_error",
    "exposed_comm_share": "exposed_comm_share",
    "max_seq_len": "max_seq_len",
}
"""results.json field -> the metric's name in the tool (None values are not written)."""
RANK_METRICS = {
    "peak_memory_bytes": "rank_peak_memory_bytes",
    "median_s": "rank_time_median_s",
    "tokens_per_s": "rank_tokens_per_s",
}
"""A rank result's field -> the per-rank metric's name, logged with step = rank."""
ENVIRONMENT_TAGS = ("hosts", "gpus", "driver", "cuda", "torch", "nccl", "ray", "python",
                    "cpu_threads", "git_sha", "git_dirty", "plugins", "plugin_code")  # fmt: skip


@dataclass
class RunRecord:
    """What one run exports."""

    run_id: int
    name: str
    status: str
    params: dict[str, str]
    metrics: dict[str, float]
    rank_metrics: dict[str, list[tuple[int, float]]]
    tags: dict[str, str]
    artifacts: list[Path] = field(default_factory=list)
    """The run's kept files (profiler traces, memory snapshots), downloaded."""


@dataclass
class SweepRecord:
    """A sweep's export: its identity, report.md and its runs."""

    sweep_id: int
    name: str
    created_at: str
    report_md: str
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def key(self) -> str:
        """What tells this sweep from a same-numbered one of another database."""
        return f"{self.sweep_id}-{self.created_at}"


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in sorted(value.items()):
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value if isinstance(value, str) else json.dumps(value)


def cell_params(config: dict[str, Any]) -> dict[str, str]:
    """The cell (its config without names, timeouts and iteration counts), flattened:
    params.window, seq_len, ... as strings."""
    out: dict[str, str] = {}
    _flat("", {k: v for k, v in config.items() if k not in NOT_MEASURED_FIELDS}, out)
    return out


def environment_tags(env: dict[str, Any] | None) -> dict[str, str]:
    """The environment and code version as `env.<field>` tags (JSON for lists and dicts)."""
    if env is None:
        return {}
    tags: dict[str, str] = {}
    for name in ENVIRONMENT_TAGS:
        value = env.get(name)
        if value is not None:
            tags[f"env.{name}"] = value if isinstance(value, str) else json.dumps(value)
    return tags


def run_record(row: dict[str, Any], run: dict[str, Any], sweep: SweepRecord) -> RunRecord:
    """One run's record from its results.json row and its GET /runs/{id}."""
    metrics = {name: float(row[k]) for k, name in METRICS.items() if row.get(k) is not None}
    ranks = run.get("rank_results") or []
    rank_metrics = {
        name: [(r["rank"], float(r[k])) for r in ranks if r.get(k) is not None]
        for k, name in RANK_METRICS.items()
    }
    tags = {
        "ringlab.sweep_id": str(sweep.sweep_id),
        "ringlab.sweep_name": sweep.name,
        "ringlab.sweep_created_at": sweep.created_at,
        "ringlab.run_id": str(row["run_id"]),
        "ringlab.status": row["status"],
        "ringlab.label": row.get("label") or "",
        **environment_tags(run.get("environment")),
    }
    return RunRecord(
        run_id=row["run_id"],
        name=f"run {row['run_id']}: {row.get('label') or row['kernel']}",
        status=row["status"],
        params=cell_params(run["config"]),
        metrics=metrics,
        rank_metrics={k: v for k, v in rank_metrics.items() if v},
        tags=tags,
    )


def _download(client: Any, run_id: int, directory: Path) -> list[Path]:
    """The run's kept artifacts, downloaded into `directory` (refused ones have no bytes)."""
    files = []
    for artifact in client.request("GET", f"/runs/{run_id}/artifacts").json():
        if artifact["url"] is None:
            continue
        path = directory / f"run-{run_id}" / artifact["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(
            client.request("GET", f"/runs/{run_id}/artifacts/{artifact['name']}").content
        )
        files.append(path)
    return files


def collect(client: Any, sweep_id: int, artifacts_to: Path | None = None) -> SweepRecord:
    """The sweep's records through the API: results.json (the read model), each run's ranks,
    config and environment, report.md, and with `artifacts_to` each run's kept artifacts
    downloaded there."""
    sweep = client.sweep(sweep_id)
    record = SweepRecord(sweep_id, sweep["name"], sweep["created_at"], client.report(sweep_id))
    for row in client.results(sweep_id):
        run = client.request("GET", f"/runs/{row['run_id']}").json()
        record.runs.append(run_record(row, run, record))
        if artifacts_to is not None:
            record.runs[-1].artifacts = _download(client, row["run_id"], artifacts_to)
    return record
