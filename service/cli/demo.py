"""`ringlab demo`: the service with a local CPU Ray, the bundled cpu-quick sweep submitted
to it and followed to its end, then a line per configuration at the longest length."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from platformdirs import user_data_dir

from service.cli.console import CliError, friendly_errors, out
from service.cli.processes import DATABASE_RULE, server, start_serving
from service.cli.specs import load_specs
from service.cli.text import state_counts
from service.client import Client, ClientError
from service.core.config import Settings, exposure_problem
from service.units import plural, time_unit

DEMO_EXAMPLE = "cpu-quick.yaml"


DEMO_HELP = (
    "Start the service with a local CPU Ray, submit cpu-quick.yaml, keep serving until "
    f"Ctrl-C. Prints the dashboard and database URLs first. {DATABASE_RULE}"
)
"""`ringlab demo --help`'s text (a docstring cannot name DATABASE_RULE)."""


def _demo_settings(port: int, database_url: str | None) -> Settings:
    """The demo's settings: a local Ray, on 127.0.0.1:port, with `database_url` when given."""
    overrides: dict[str, Any] = {"ray_address": None, "host": "127.0.0.1", "port": port}
    if database_url:
        overrides["database_url"] = database_url
    settings = Settings(**overrides)
    if problem := exposure_problem(settings, "127.0.0.1"):
        raise CliError(problem)
    return settings


def _submit_demo(base: str, spec: dict[str, Any], give_up: Callable[[str], None]) -> None:
    """Wait for the service at `base` (120 s at most), submit the demo sweep, say where to
    see it, then follow it to its end (announce_end); `give_up(reason)` when either fails."""
    with Client(base) as client:
        deadline = time.monotonic() + 120
        while not client.healthy():
            if time.monotonic() > deadline:
                give_up(f"the service did not answer at {base} in 120 s")
                return
            time.sleep(0.5)
        try:
            sweep = client.submit(spec)
        except ClientError as e:
            give_up(f"could not submit {DEMO_EXAMPLE}: {e}")
            return
        runs = plural(sweep["total"], "run")
        out.print(
            f"[bold]demo sweep {sweep['id']}[/bold] ({runs}) submitted.\n"
            f"Dashboard: {client.dashboard_url(sweep['id'])}\n"
            f"Terminal:  RINGLAB_URL={base} ringlab watch {sweep['id']}\n"
            "Ctrl-C stops the service."
        )
        announce_end(client, sweep["id"])


def _demo_access_log(access_log: Path | None) -> Path:
    """Where uvicorn's access lines go (its folder made): `access_log`, else
    demo-access.log in the user's data dir."""
    log_file = access_log or Path(user_data_dir("ringlab")) / "demo-access.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    return log_file


@friendly_errors
def demo(
    port: Annotated[
        int, typer.Option(min=1, max=65535, help="Port to serve on (make run: PORT=8001).")
    ] = 8000,
    database_url: Annotated[
        str | None,
        typer.Option(help="Database (default: RINGLAB_DATABASE_URL or ringlab.db, as serve)."),
    ] = None,
    access_log: Annotated[
        Path | None,
        typer.Option(
            help="Where uvicorn's access lines go (default: demo-access.log beside the "
            "default database, in the user's data dir); the terminal keeps ringlab's lines."
        ),
    ] = None,
) -> None:
    settings = _demo_settings(port, database_url)
    (spec,) = load_specs(DEMO_EXAMPLE)
    base = f"http://127.0.0.1:{port}"

    failure: list[str] = []

    def give_up(reason: str) -> None:
        # The demo without its sweep is no demo: stop the server (uvicorn's graceful SIGTERM
        # path) and exit non-zero with the reason, after the server has shut down.
        failure.append(reason)
        os.kill(os.getpid(), signal.SIGTERM)

    how = "pick another: PORT={port} make run, or ringlab demo --port {port}"
    sockets = start_serving(settings, "127.0.0.1", port, how)
    log_file = _demo_access_log(access_log)
    out.print(f"starting ringlab on {base} with a local Ray on CPU")
    out.print(f"access log: {log_file} (each page view; ringlab demo --access-log PATH)")
    run_server = server()
    threading.Thread(
        target=_submit_demo, args=(base, spec, give_up), name="demo-submit", daemon=True
    ).start()
    run_server(
        settings,
        host="127.0.0.1",
        port=port,
        with_scheduler=True,
        sockets=sockets,
        access_log=str(log_file),
    )
    if failure:
        raise CliError(failure[0])


def announce_end(client: Any, sweep_id: int) -> None:
    """Follow the demo's sweep to its end, then say so in one line with its URL, and give
    three rows: each configuration at the longest length (time, tokens/s, speedup)."""
    for event, _ in client.events(sweep_id):
        if event == "end":
            break
    s = client.sweep(sweep_id)
    out.print(
        f"[bold]demo sweep {sweep_id} ended[/bold] ({state_counts(s['counts'])}): "
        f"{client.dashboard_url(sweep_id)}",
        soft_wrap=True,
    )
    for line in demo_summary(client.results(sweep_id)):
        out.print(line, markup=False)


def demo_summary(rows: list[dict[str, Any]], most: int = 3) -> list[str]:
    """At the longest length measured, each configuration's time, tokens/s and speedup, one
    line each (at most `most`): "  ring · W=2 · sequence-parallel at 2,048: 12.3 ms, ..."."""
    timed = [r for r in rows if r.get("median_s") is not None]
    if not timed:
        return ["  no run measured a time: ringlab results shows why"]
    longest = max(r["seq_len"] for r in timed)
    at = sorted((r for r in timed if r["seq_len"] == longest), key=lambda r: r["run_id"])
    unit = time_unit(r["median_s"] for r in at)
    lines = []
    for r in at[:most]:
        speedup = f", {r['speedup']:.2f}x vs {r['baseline']}" if r.get("speedup") else ""
        lines.append(
            f"  {r['label']} at {longest:,}: {unit(r['median_s'])}, "
            f"{r['tokens_per_s']:,.0f} tokens/s{speedup}"
        )
    return lines
