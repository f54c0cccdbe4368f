"""`ringlab compare` (the regression gate) and `ringlab export`: client commands kept apart from
service.cli's own, registered on its app when service.cli loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from service import regression
from service.cli_base import CliError, app, client, friendly_errors, out


@app.command()
@friendly_errors
def compare(
    a: Annotated[int, typer.Argument(help="Sweep A: the reference (the last green run).")],
    b: Annotated[int, typer.Argument(help="Sweep B: the new code.")],
    fail_on_regression: Annotated[
        bool, typer.Option(help="Exit 1 when any matching cell is worse (for CI).")
    ] = False,
    metric: Annotated[
        str, typer.Option(help=f"What to compare: {', '.join(regression.METRICS)}.")
    ] = "median_s",
    threshold: Annotated[str, typer.Option(help="Ignore moves smaller than this, e.g. 5%.")] = "5%",
) -> None:
    """Print the cells of B that moved against A on one metric: a time beyond both sweeps'
    spreads (their median intervals, each at 95% or more, do not overlap) and the threshold,
    memory and maximum length beyond the threshold, and cells that succeeded in A but not in
    B. A time from fewer than 6 iterations (an interval below 95%) is too few to tell: said,
    never a regression."""
    try:
        fraction = regression.parse_threshold(threshold)
        if metric not in regression.METRICS:
            raise ValueError(f"--metric: one of {', '.join(regression.METRICS)}, got {metric!r}")
    except ValueError as e:
        raise CliError(str(e)) from None
    with client() as c:
        answer = c.request("GET", f"/sweeps/{a}/compare/{b}").json()
    if not answer["pairs"]:
        raise CliError(f"sweeps {a} and {b} have no cell in common: nothing to compare")
    moved = regression.moves(answer, metric, fraction)
    for move in moved:
        word = "worse" if move.worse else "better"
        out.print(f"{word}  {move.label}  runs {move.a_run_id} -> {move.b_run_id}: {move.text}",
                  markup=False)  # fmt: skip
    unsure = regression.untold(answer, metric, fraction)
    for move in unsure:
        out.print(f"untold  {move.label}  runs {move.a_run_id} -> {move.b_run_id}: {move.text}",
                  markup=False)  # fmt: skip
    worse = sum(m.worse for m in moved)
    told = f"; {len(unsure)} moved beyond {threshold} with {regression.TOO_FEW}" if unsure else ""
    out.print(
        f"{len(answer['pairs'])} matching cells (only in A {answer['only_a']}, only in B "
        f"{answer['only_b']}): {worse} worse, {len(moved) - worse} better on {metric} beyond "
        f"both spreads (intervals at 95% or more) and {threshold}{told}",
        markup=False,
    )
    if fail_on_regression and worse:
        raise typer.Exit(1)


EXPORTERS = {"mlflow": "mlruns", "wandb": ".", "tensorboard": "runs"}
"""Each tool and its default --uri: MLflow's tracking URI (a path: a file store), the directory
W&B writes its offline runs under, TensorBoard's log directory."""


def _exporter(tool: str) -> Any:
    """The tool's exporter module; a CliError naming the extra to install when its library is
    missing."""
    import importlib

    try:
        importlib.import_module({"mlflow": "mlflow", "wandb": "wandb",
                                 "tensorboard": "tensorboard"}[tool])  # fmt: skip
    except ImportError:
        raise CliError(
            f"--to {tool}: its client library is not installed: pip install 'ringlab[{tool}]'"
        ) from None
    return importlib.import_module(f"service.results.trackers.{tool}_export")


@app.command()
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
    import tempfile

    from service.results.trackers import collect

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
