"""`ringlab export`: a sweep's runs written to MLflow, W&B or TensorBoard through each tool's
own client library (an optional extra: `pip install 'ringlab[mlflow]'`)."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from service.cli.console import CliError, client, friendly_errors, out

EXPORTERS = {"mlflow": "mlruns", "wandb": ".", "tensorboard": "runs"}
"""Each tool and its default --uri: MLflow's tracking URI (a path: a file store), the directory
W&B writes its offline runs under, TensorBoard's log directory."""


def _exporter(tool: str) -> Any:
    """The tool's exporter module; a CliError naming the extra to install when its library is
    missing."""
    try:
        importlib.import_module({"mlflow": "mlflow", "wandb": "wandb",
                                 "tensorboard": "tensorboard"}[tool])  # fmt: skip
    except ImportError:
        raise CliError(
            f"--to {tool}: its client library is not installed: pip install 'ringlab[{tool}]'"
        ) from None
    return importlib.import_module(f"service.results.trackers.{tool}_export")


@friendly_errors
def export(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    to: Annotated[str | None, typer.Option("--to", help="mlflow | wandb | tensorboard")] = None,
    uri: Annotated[
        str | None,
        typer.Option(
            help="MLflow tracking URI (default ./mlruns, a file store), the directory "
            "W&B writes offline runs under (default .), or TensorBoard's log directory "
            "(default ./runs)."
        ),
    ] = None,
) -> None:
    """Write the sweep's runs to MLflow, W&B or TensorBoard: the cell as params, time,
    tokens/s, TFLOP/s, peak memory (per rank too), gate error and exposed communication as
    metrics, the environment and code version as tags, report.md attached. Exporting again
    updates the same runs."""
    from service.results.trackers import collect  # ~370 ms: kept off start-up

    if to not in EXPORTERS:
        got = "nothing" if to is None else repr(to)
        raise CliError(f"--to: one of {', '.join(EXPORTERS)}, got {got}")
    module = _exporter(to)
    target = uri or EXPORTERS[to]
    with tempfile.TemporaryDirectory(prefix="ringlab-export-") as work, client() as c:
        if to == "tensorboard":  # event files hold no files: no artifacts to fetch
            out.print(module.export(collect(c, sweep_id), target), markup=False)
            return
        record = collect(c, sweep_id, artifacts_to=Path(work))
        out.print(module.export(record, target, Path(work)), markup=False)
