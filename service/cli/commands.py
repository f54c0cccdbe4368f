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

COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("serve", processes.serve), ("scheduler", processes.scheduler), ("demo", demo.demo),
    ("submit", submit.submit), ("watch", watch.watch), ("ls", sweeps.list_sweeps),
    ("show", sweeps.show), ("results", results.results), ("report", results.report),
    ("cancel", sweeps.cancel), ("retry", sweeps.retry), ("delete", sweeps.delete),
    ("cluster", sweeps.cluster), ("kernels", kernels.kernels), ("compare", compare.compare),
    ("export", export.export),
)  # fmt: skip
"""Each command's name and function, in `ringlab --help`'s order."""

HELP_TEXTS = {"serve": processes.SERVE_HELP, "demo": demo.DEMO_HELP}
"""The commands whose help is not their function's docstring, with their help text."""

DB_COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("upgrade", database.db_upgrade),
    ("downgrade", database.db_downgrade),
    ("current", database.db_current),
)
"""`ringlab db`'s commands."""

for name, command in COMMANDS:
    app.command(name, help=HELP_TEXTS.get(name))(command)
for name, command in DB_COMMANDS:
    db_app.command(name)(command)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
