"""`ringlab serve` and `ringlab scheduler`: the service's long-running processes, and what
serve and demo do before uvicorn starts."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from typing import Annotated

import typer

from service.cli.console import CliError, err, friendly_errors, out
from service.cli.database import load_settings, migrations, safe_url
from service.cli.ports import browser_url, check_port
from service.core.config import Settings, exposure_problem


def start_serving(settings: Settings, host: str, port: int, how: str) -> list[socket.socket]:
    """What serve and demo do before uvicorn: the port taken (its sockets returned for
    uvicorn), the database URL (password hidden) and dashboard URL printed, the database
    migrated (unreachable: one line)."""
    sockets = check_port(host, port, how)
    out.print(f"dashboard: {browser_url(host, port)}/")
    out.print(f"database:  {safe_url(settings)}")
    migrations().upgrade(settings.database_url)
    return sockets


def server() -> Callable[..., None]:
    """service.app.run_server (uvicorn until SIGTERM/SIGINT), imported when serve or demo is
    about to start it."""
    from service.app import run_server  # the whole service: seconds, kept off start-up

    return run_server


DATABASE_RULE = (
    "Database: RINGLAB_DATABASE_URL, by default SQLite ringlab.db in the user's data dir; "
    "`ringlab serve` and `ringlab demo` use the same one."
)


SERVE_HELP = (
    "Serve the API and the dashboard; unless --no-scheduler, run the scheduler in-process. "
    f"Prints the dashboard and database URLs first. {DATABASE_RULE}"
)
"""`ringlab serve --help`'s text (a docstring cannot name DATABASE_RULE)."""


@friendly_errors
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (RINGLAB_HOST).")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port (RINGLAB_PORT).")] = None,
    no_scheduler: Annotated[
        bool, typer.Option("--no-scheduler", help="Serve the API only; run `ringlab scheduler`.")
    ] = False,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Serve on a non-loopback address without RINGLAB_API_TOKEN (refused without).",
        ),
    ] = False,
) -> None:
    settings = load_settings()
    host = settings.host if host is None else host
    port = port or settings.port
    if problem := exposure_problem(settings, host, insecure=insecure):
        raise CliError(problem)
    sockets = start_serving(settings, host, port, "pick another: ringlab serve --port {port}")
    run_server = server()
    run_server(settings, host=host, port=port, with_scheduler=not no_scheduler, sockets=sockets)


@friendly_errors
def scheduler() -> None:
    """Run a scheduler alone (deployments with several API replicas on Postgres)."""
    from service.db.engine import make_engine, make_sessionmaker  # ~120 ms: kept off start-up
    from service.ray_supervisor import Supervisor  # Ray, ~1 s: kept off start-up

    settings = load_settings()
    migrations().upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    err.print(f"scheduler on {safe_url(settings)}; SIGTERM or Ctrl-C stops it cleanly")
    # Ray lives in a driver process this one supervises: losing Ray never ends this process.
    try:
        Supervisor(settings, make_sessionmaker(engine), schedule=True).run(stop)
    finally:
        engine.dispose()
