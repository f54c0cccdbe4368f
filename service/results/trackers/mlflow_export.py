"""MLflow: one experiment per sweep, one MLflow run per ringlab run (MlflowClient, never HTTP
by hand). A run is found again by its tags ringlab.run_id and ringlab.sweep_created_at: params
already there are kept (MLflow never changes one), a metric is logged only where its value at
that step differs, tags are set again and report.md replaces the earlier copy."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from service.results.trackers import RunRecord, SweepRecord

FILE_STORE_OPT_IN = "MLFLOW_ALLOW_FILE_STORE"
"""MLflow 3 refuses a file store (./mlruns) unless this is true; a --uri naming one asks for it."""


def tracking_uri(uri: str) -> str:
    """A path or file: URI as a file store's URI (and MLflow's opt-in to it set); any other
    URI (sqlite:///..., http://...) as given."""
    if "://" in uri and not uri.startswith("file:"):
        return uri
    os.environ[FILE_STORE_OPT_IN] = "true"
    return uri if uri.startswith("file:") else Path(uri).resolve().as_uri()


def _existing(client: Any, experiment_id: str, sweep: SweepRecord) -> dict[str, Any]:
    """ringlab run id -> the MLflow run already exported for this sweep."""
    found: dict[str, Any] = {}
    token = None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`ringlab.sweep_created_at` = '{sweep.created_at}'",
            max_results=1000,
            page_token=token,
        )
        for run in page:
            found[run.data.tags["ringlab.run_id"]] = run
        token = page.token
        if not token:
            return found


def _metrics(client: Any, run_id: str, record: RunRecord, latest: dict[str, float]) -> list[Any]:
    """The Metric entries not already there with the same value at the same step."""
    from mlflow.entities import Metric  # optional package (mlflow)

    now = int(time.time() * 1000)
    out = [Metric(k, v, now, 0) for k, v in record.metrics.items() if latest.get(k) != v]
    for key, points in record.rank_metrics.items():
        have = (
            {m.step: m.value for m in client.get_metric_history(run_id, key)}
            if key in latest
            else {}
        )
        out += [Metric(key, v, now, rank) for rank, v in points if have.get(rank) != v]
    return out


def _write_run(client: Any, experiment_id: str, record: RunRecord, old: Any, report: Path) -> None:
    from mlflow.entities import Param, RunTag  # optional package (mlflow)

    if old is None:
        run_id = client.create_run(
            experiment_id, tags=record.tags, run_name=record.name
        ).info.run_id
        params, latest = {}, {}
    else:
        run_id, params, latest = old.info.run_id, old.data.params, old.data.metrics
    new_params = [Param(k, v) for k, v in record.params.items() if k not in params]
    tags = [RunTag(k, v) for k, v in record.tags.items()]
    metrics = _metrics(client, run_id, record, latest)
    client.log_batch(run_id, metrics=metrics[:1000], params=new_params, tags=tags)
    for start in range(1000, len(metrics), 1000):  # MLflow takes 1000 metrics a batch
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    client.log_artifact(run_id, str(report))
    for path in record.artifacts:  # traces, memory snapshots
        client.log_artifact(run_id, str(path), artifact_path="artifacts")
    client.set_terminated(run_id, "FINISHED" if record.status == "succeeded" else "FAILED")


def export(sweep: SweepRecord, uri: str, workdir: Path) -> str:
    """Write the sweep to the MLflow tracking store at `uri`; a one-line summary."""
    from mlflow import MlflowClient  # optional package (mlflow)

    client = MlflowClient(tracking_uri=tracking_uri(uri))
    name = f"ringlab sweep {sweep.sweep_id}: {sweep.name}"
    experiment = client.get_experiment_by_name(name)
    experiment_id = (
        experiment.experiment_id if experiment is not None else client.create_experiment(name)
    )
    report = workdir / "report.md"
    report.write_text(sweep.report_md)
    existing = _existing(client, experiment_id, sweep)
    for record in sweep.runs:
        _write_run(client, experiment_id, record, existing.get(str(record.run_id)), report)
    updated = sum(str(r.run_id) in existing for r in sweep.runs)
    return (f"mlflow: {len(sweep.runs) - updated} runs created, {updated} updated in experiment "
            f"{name!r} at {client.tracking_uri}")  # fmt: skip
