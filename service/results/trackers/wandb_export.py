"""Weights & Biases: one W&B run per ringlab run, grouped by sweep, through the wandb library.
Offline (files under `<dir>/wandb/`, for `wandb sync` later) when no WANDB_API_KEY is set,
online otherwise (WANDB_BASE_URL names a server). The cell is the run's config (the full
environment under `environment`), the run's numbers its summary, the per-rank metrics its
history with the rank as the step, the environment's short facts its tags, report.md a saved
file. A run's id is fixed by the sweep and run, so exporting again resumes the same W&B run;
offline, the earlier export's files of that run are replaced."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from service.results.trackers import RunRecord, SweepRecord

MAX_TAG_CHARS = 64
"""W&B's limit on a tag's length: longer facts stay in the config only."""


def run_id(sweep: SweepRecord, record: RunRecord) -> str:
    """The W&B run id of a ringlab run: the same on every export of the same sweep."""
    digest = hashlib.sha256(sweep.key.encode()).hexdigest()[:8]
    return f"ringlab-{sweep.sweep_id}-{record.run_id}-{digest}"


def _tags(record: RunRecord) -> list[str]:
    tags = [f"{k.removeprefix('env.')}={v}" for k, v in record.tags.items() if k.startswith("env.")]
    return [t for t in tags if len(t) <= MAX_TAG_CHARS]


def _write_run(wandb: Any, sweep: SweepRecord, record: RunRecord, directory: Path,
               offline: bool, report: Path) -> None:  # fmt: skip
    rid = run_id(sweep, record)
    if offline:  # the earlier export of this run is replaced, not kept beside it
        for old in (directory / "wandb").glob(f"offline-run-*-{rid}"):
            shutil.rmtree(old)
    run = wandb.init(
        mode="offline" if offline else "online",
        dir=str(directory),
        project="ringlab",
        group=f"sweep {sweep.sweep_id}: {sweep.name}",
        name=record.name,
        id=rid,
        resume="allow",
        config={**record.params, "environment": record.tags},
        tags=_tags(record),
        settings=wandb.Settings(silent=True, x_disable_stats=True, save_code=False),
    )
    ranks = sorted({rank for points in record.rank_metrics.values() for rank, _ in points})
    for rank in ranks:
        values = {k: v for k, points in record.rank_metrics.items() for r, v in points if r == rank}
        run.log({**values, "rank": rank}, step=rank)
    run.summary.update(record.metrics)
    saved = Path(run.dir) / "report.md"  # a copy: wandb.save would only link to `report`
    shutil.copyfile(report, saved)
    run.save(str(saved), base_path=run.dir, policy="now")
    for path in record.artifacts:  # traces, memory snapshots, under files/artifacts/
        kept = Path(run.dir) / "artifacts" / path.name
        kept.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, kept)
        run.save(str(kept), base_path=run.dir, policy="now")
    run.finish(exit_code=0 if record.status == "succeeded" else 1)


def export(sweep: SweepRecord, uri: str, workdir: Path) -> str:
    """Write the sweep's runs to W&B (offline under `uri` without a key); a one-line summary."""
    import wandb  # optional package (wandb)

    directory = Path(uri).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    offline = not os.environ.get("WANDB_API_KEY")
    report = workdir / "report.md"
    report.write_text(sweep.report_md)
    for record in sweep.runs:
        _write_run(wandb, sweep, record, directory, offline, report)
    where = f"offline under {directory / 'wandb'}" if offline else "online"
    return f"wandb: {len(sweep.runs)} runs written {where} (project ringlab)"
