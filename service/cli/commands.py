"""The `ringlab` app: every command registered here by name, in the order `ringlab --help` lists
them, each from the module of its concept; and the console script's entry point."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

from service.cli import (
    compare,
    database,
    demo,
    export,
    kernels,
    processes,
    results,
    submit,
    sweeps,
    watch,
)

app = typer.Typer(
    name="ringlab",
    help="Run and compare long-context attention experiments on a Ray cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
app.add_typer(db_app, name="db")

COMMANDS: tuple[tuple[str, Callable[..., None], str | None], ...] = (
    ("serve", processes.serve, processes.SERVE_HELP),
    ("scheduler", processes.scheduler, None),
    ("demo", demo.demo, demo.DEMO_HELP),
    ("submit", submit.submit, None),
    ("watch", watch.watch, None),
    ("ls", sweeps.list_sweeps, None),
    ("show", sweeps.show, None),
    ("results", results.results, None),
    ("report", results.report, None),
    ("cancel", sweeps.cancel, None),
    ("retry", sweeps.retry, None),
    ("delete", sweeps.delete, None),
    ("cluster", sweeps.cluster, None),
    ("kernels", kernels.kernels, None),
    ("compare", compare.compare, None),
    ("export", export.export, None),
)
"""Each command's name, function and help text (None: the function's docstring)."""

DB_COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("upgrade", database.db_upgrade),
    ("downgrade", database.db_downgrade),
    ("current", database.db_current),
)
"""`ringlab db`'s commands."""

for name, command, help_text in COMMANDS:
    app.command(name, help=help_text)(command)
for name, command in DB_COMMANDS:
    db_app.command(name)(command)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
