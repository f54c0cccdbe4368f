"""`ringlab compare`: the regression gate, the cells of one sweep that moved against another's
on one metric, beyond both sweeps' spreads and a threshold."""

from __future__ import annotations

from typing import Annotated

import typer

from service import regression
from service.cli.console import CliError, client, friendly_errors, out


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
