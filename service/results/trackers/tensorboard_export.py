"""TensorBoard: event files under `<logdir>/ringlab-sweep-<id>/run-<run>/`, written by torch's
SummaryWriter (the `tensorboard` package is its extra). Each run's directory holds the cell as
hparams (with the run's metrics, so TensorBoard's HParams view compares cells), the per-rank
metrics with the rank as the step, the environment as text; report.md is the text of the
sweep's `report` directory (event files hold no files: a run's traces are not exported here).
TensorBoard has no update: exporting again removes the event files it wrote before (and only
those) and writes them anew."""

from __future__ import annotations

import json
from pathlib import Path

from service.results.trackers import SweepRecord

EVENTS = "events.out.tfevents.*"


def _fresh(directory: Path) -> Path:
    """`directory`, emptied of the event files an earlier export wrote."""
    if directory.exists():
        for old in directory.rglob(EVENTS):
            old.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _table(values: dict[str, str]) -> str:
    return "\n".join(["| key | value |", "| --- | --- |"]
                     + [f"| {k} | {v} |" for k, v in sorted(values.items())])  # fmt: skip


def export(sweep: SweepRecord, logdir: str) -> str:
    """Write the sweep's event files under `logdir`; a one-line summary."""
    from torch.utils.tensorboard import SummaryWriter  # optional package (tensorboard)

    root = Path(logdir).resolve() / f"ringlab-sweep-{sweep.sweep_id}"
    with SummaryWriter(str(_fresh(root / "report"))) as writer:
        writer.add_text("report.md", sweep.report_md)
        writer.add_text("sweep", json.dumps({"id": sweep.sweep_id, "name": sweep.name,
                                             "created_at": sweep.created_at}))  # fmt: skip
    for record in sweep.runs:
        with SummaryWriter(str(_fresh(root / f"run-{record.run_id}"))) as writer:
            writer.add_hparams(record.params, record.metrics, run_name=".")
            for key, points in record.rank_metrics.items():
                for rank, value in points:
                    writer.add_scalar(key, value, global_step=rank)
            writer.add_text("tags", _table(record.tags))
    return f"tensorboard: {len(sweep.runs)} runs written under {root}"
