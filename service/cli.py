"""The `ringlab` command line (typer + rich). Errors are one readable line and a non-zero exit."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

from service.client import ClientError
from service.core.config import Settings

app = typer.Typer(
    name="ringlab",
    help="Run and compare long-context attention experiments on a Ray cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
app.add_typer(db_app, name="db")

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])


class CliError(Exception):
    """An error to show the user as one line."""


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "settings"
        field = f"RINGLAB_{loc.upper()}" if first["loc"] else loc
        return f"invalid setting {field}: {first['msg'].removeprefix('Value error, ')}"
    if isinstance(exc, OperationalError):
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        return f"cannot reach the database: {reason}"
    if isinstance(exc, NoSuchModuleError | ArgumentError):
        return f"bad database URL: {exc}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def friendly_errors(fn: F) -> F:
    """Turn known failures into one red line on stderr and exit code 1."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (
            CliError,
            ClientError,
            ValidationError,
            OperationalError,
            NoSuchModuleError,
            ArgumentError,
            ConnectionError,  # Ray: no cluster at RINGLAB_RAY_ADDRESS
        ) as e:
            err.print(f"[red]error:[/red] {_one_line(e)}")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def load_settings() -> Settings:
    """Settings from the environment; a bad value becomes a CliError-style exit."""
    return Settings()


@db_app.command("upgrade")
@friendly_errors
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Bring the database (RINGLAB_DATABASE_URL) to the latest schema."""
    from service.db.migrate import current, upgrade

    settings = load_settings()
    upgrade(settings.database_url, revision)
    out.print(f"database at revision {current(settings.database_url)}: {_safe(settings)}")


@db_app.command("downgrade")
@friendly_errors
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' empties it).")],
) -> None:
    """Take the database back to an earlier revision."""
    from service.db.migrate import current, downgrade

    settings = load_settings()
    downgrade(settings.database_url, revision)
    out.print(f"database at revision {current(settings.database_url)}: {_safe(settings)}")


@db_app.command("current")
@friendly_errors
def db_current() -> None:
    """Print the database's current revision."""
    from service.db.migrate import current

    settings = load_settings()
    out.print(current(settings.database_url) or "empty (no revision)")


# ---- processes: the service, a scheduler alone, the demo ----


@app.command()
@friendly_errors
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (RINGLAB_HOST).")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port (RINGLAB_PORT).")] = None,
    no_scheduler: Annotated[
        bool, typer.Option("--no-scheduler", help="Serve the API only; run `ringlab scheduler`.")
    ] = False,
) -> None:
    """Serve the API and the dashboard; unless --no-scheduler, run the scheduler in-process."""
    from service.app import run_server

    run_server(load_settings(), host=host, port=port, with_scheduler=not no_scheduler)


@app.command()
@friendly_errors
def scheduler() -> None:
    """Run a scheduler alone (deployments with several API replicas on Postgres)."""
    import signal
    import threading

    from service.scheduler import run_forever_from_settings
    from workers import cluster

    settings = load_settings()
    # Ray first: ray.init() in the main thread installs its own SIGTERM handler (sys.exit),
    # which would kill the scheduler mid-run; ours must be installed after it.
    cluster.connect(settings.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    err.print(f"scheduler on {_safe(settings)}; SIGTERM or Ctrl-C stops it cleanly")
    run_forever_from_settings(settings, stop)


DEMO_EXAMPLE = "cpu-quick.yaml"


@app.command()
@friendly_errors
def demo(
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to serve on.")] = 8000,
    database_url: Annotated[
        str | None,
        typer.Option(help="Database (default: demo.db, SQLite, in the user's data dir)."),
    ] = None,
) -> None:
    """Start the service on SQLite with a local CPU Ray, submit cpu-quick.yaml, keep serving."""
    import os
    import signal
    import threading

    from platformdirs import user_data_dir

    from service.app import run_server
    from service.client import Client

    url = database_url or f"sqlite:///{Path(user_data_dir('ringlab')) / 'demo.db'}"
    settings = Settings(database_url=url, ray_address=None, host="127.0.0.1", port=port)
    (spec,) = load_specs(DEMO_EXAMPLE)
    base = f"http://127.0.0.1:{port}"

    failure: list[str] = []

    def give_up(reason: str) -> None:
        # The demo without its sweep is no demo: stop the server (uvicorn's graceful SIGTERM
        # path) and exit non-zero with the reason, after the server has shut down.
        failure.append(reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def submit_when_ready() -> None:
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
            out.print(
                f"[bold]demo sweep {sweep['id']}[/bold] ({sweep['total']} runs) submitted.\n"
                f"Dashboard: {client.dashboard_url(sweep['id'])}\n"
                f"Terminal:  RINGLAB_URL={base} ringlab watch {sweep['id']}\n"
                "Ctrl-C stops the service."
            )

    out.print(f"starting ringlab on {base} (database {_safe(settings)}, local Ray on CPU)")
    threading.Thread(target=submit_when_ready, name="demo-submit", daemon=True).start()
    run_server(settings, host="127.0.0.1", port=port, with_scheduler=True)
    if failure:
        raise CliError(failure[0])


# ---- client commands: talk to a running service over HTTP ----


def client() -> Any:
    """A client for RINGLAB_URL with RINGLAB_API_TOKEN."""
    from service.client import Client

    return Client()


def load_specs(file: str) -> list[dict[str, Any]]:
    """The sweep specs of a YAML file (one per document), or of a bundled example by name."""
    import yaml

    path = Path(file)
    if path.is_file():
        text = path.read_text()
    else:
        from importlib.resources import files

        bundled = files("service.examples").joinpath(path.name)
        if path.parent != Path(".") or not bundled.is_file():
            raise CliError(f"{file}: no such file (nor a bundled example of that name)")
        text = bundled.read_text()
    try:
        specs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as e:
        raise CliError(f"{file}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not specs:
        raise CliError(f"{file}: no sweep spec in it")
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise CliError(f"{file}: document {i + 1} is not a mapping (name, kind, base, grid...)")
    return specs


@app.command()
@friendly_errors
def submit(
    file: Annotated[str, typer.Argument(help="Sweep spec (YAML), or a bundled example's name.")],
    watch_: Annotated[bool, typer.Option("--watch", help="Follow it until it ends.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submitting again with the same key returns the same sweep.")
    ] = None,
) -> None:
    """Submit a sweep (one per YAML document); print each id and dashboard URL."""
    specs = load_specs(file)
    if watch_ and len(specs) > 1:
        raise CliError(f"{file}: --watch follows one sweep; this file holds {len(specs)}")
    with client() as c:
        for i, spec in enumerate(specs):
            key = (
                f"{idempotency_key}-{i}" if idempotency_key and len(specs) > 1 else idempotency_key
            )
            sweep = c.submit(spec, idempotency_key=key)
            out.print(f"sweep {sweep['id']} ({sweep['name']}): {sweep['total']} runs")
            out.print(f"dashboard: {c.dashboard_url(sweep['id'])}")
        if watch_:
            _watch(c, sweep["id"])


FAILED_STATES = ("failed", "timed_out")


def _watch(c: Any, sweep_id: int) -> None:
    """A progress bar from the sweep's events until it ends; exit 1 if any run failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    sweep = c.sweep(sweep_id)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task(
            f"sweep {sweep_id}", total=sweep["total"], completed=sweep["finished"], counts=""
        )
        ended = False
        for event, data in c.events(sweep_id):
            if event == "end" and data.get("deleted"):
                raise CliError(f"sweep {sweep_id} was deleted while watching")
            if event in ("progress", "end") and "counts" in data:
                sweep = data
                progress.update(task, completed=data["finished"], counts=_counts(data["counts"]))
            if event == "end":
                ended = True
                break
    if not ended:  # the stream closed early (a restart, a proxy): ask where the sweep is
        sweep = c.sweep(sweep_id)
        if not sweep["done"]:
            raise CliError(
                f"the event stream of sweep {sweep_id} closed before the sweep ended "
                f"({sweep['finished']}/{sweep['total']} finished); watch it again"
            )
    out.print(f"sweep {sweep_id} ended: {_counts(sweep['counts'])}")
    bad = sum(sweep["counts"].get(s, 0) for s in FAILED_STATES)
    if bad:
        err.print(f"[red]{bad} run(s) failed or timed out[/red]: ringlab results {sweep_id}")
        raise typer.Exit(1)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{state} {n}" for state, n in counts.items() if n) or "no runs"


@app.command()
@friendly_errors
def watch(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """Follow a sweep with a progress bar until it ends; exit 1 if any run failed or timed out."""
    with client() as c:
        _watch(c, sweep_id)


@app.command("ls")
@friendly_errors
def list_sweeps(
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20,
) -> None:
    """List sweeps, newest first, with progress and runs by state."""
    from rich.table import Table

    with client() as c:
        page = c.sweeps(limit=limit)
    table = Table("id", "name", "kind", "created", "progress", "runs by state", box=None)
    for s in page["data"]:
        table.add_row(
            str(s["id"]),
            s["name"],
            s["kind"],
            s["created_at"][:19].replace("T", " "),
            f"{s['finished']}/{s['total']}",
            _counts(s["counts"]),
        )
    out.print(table)
    if page["count"] > len(page["data"]):
        out.print(f"[dim]{len(page['data'])} of {page['count']} sweeps (--limit)[/dim]")


@app.command()
@friendly_errors
def show(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """One sweep: kind, progress, runs by state, its spec and dashboard URL."""
    import yaml

    with client() as c:
        s = c.sweep(sweep_id)
        url = c.dashboard_url(sweep_id)
    out.print(f"[bold]sweep {s['id']}[/bold] {s['name']} ({s['kind']})")
    out.print(f"created {s['created_at'][:19].replace('T', ' ')} UTC")
    out.print(f"progress {s['finished']}/{s['total']}: {_counts(s['counts'])}")
    out.print(f"dashboard: {url}")
    out.print(yaml.safe_dump(s["spec"], sort_keys=False).rstrip(), markup=False)


RESULT_COLUMNS = (
    ("run_id", "run"),
    ("label", "configuration"),
    ("length", "length"),
    ("median_s", "time"),
    ("tokens_per_s", "tokens/s"),
    ("peak_memory_bytes", "peak mem"),
    ("max_seq_len", "max len"),
    ("baseline", "vs"),
    ("speedup", "speedup"),
)
"""The terminal table: the label already names the world size, parallel mode and dtype where
they vary; a run without a time shows its status there; every other number is in
--format csv/json. A column no row has a value for is left
out, so the table fits an 80-column terminal."""


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "—"
    if key == "speedup":
        return f"{value:.2f}x"
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "median_s":
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    if key == "tokens_per_s":
        steps = ((1e9, "G"), (1e6, "M"), (1e3, "k"))
        return next((f"{value / f:.3g} {p}" for f, p in steps if value >= f), f"{value:.3g}")
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and key != "run_id":
        return f"{value:,}"
    return str(value)


@app.command()
@friendly_errors
def results(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    format_: Annotated[str, typer.Option("--format", "-f", help="table | csv | json")] = "table",
) -> None:
    """One row per run with its headline numbers, as a table, CSV or JSON."""
    import json

    from rich.table import Table

    if format_ not in ("table", "csv", "json"):
        raise CliError(f"--format: expected table, csv or json, got {format_!r}")
    with client() as c:
        if format_ == "csv":
            sys.stdout.write(c.results_csv(sweep_id))
            return
        rows = c.results(sweep_id)
    if format_ == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    for row in rows:
        row["length"] = row["measured_seq_len"] or row["seq_len"]  # a search: its answer
    shown = [(k, t) for k, t in RESULT_COLUMNS if any(row.get(k) is not None for row in rows)]
    table = Table(box=None, pad_edge=False, collapse_padding=True)
    for key, title in shown:
        wraps = key == "label"
        table.add_column(title, no_wrap=not wraps, overflow="fold", min_width=16 if wraps else None)
    for row in rows:
        cells = [_cell(key, row.get(key)) for key, _ in shown]
        if row.get("median_s") is None and ("median_s", "time") in shown:
            cells[shown.index(("median_s", "time"))] = row["status"]
        table.add_row(*cells)
    out.print(table)


@app.command()
@friendly_errors
def report(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """The sweep's markdown report (tables in the style of the hand-written ones)."""
    with client() as c:
        sys.stdout.write(c.report(sweep_id))


@app.command()
@friendly_errors
def cancel(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """Cancel the sweep's queued, waiting and running runs."""
    with client() as c:
        answer = c.cancel(sweep_id)
    out.print(f"sweep {sweep_id}: {answer['changed']} run(s) cancelled")


@app.command()
@friendly_errors
def retry(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    include_oom: Annotated[
        bool, typer.Option(help="Also requeue runs that ran out of memory.")
    ] = False,
) -> None:
    """Put the sweep's failed and timed-out runs back in the queue."""
    with client() as c:
        answer = c.retry(sweep_id, include_oom=include_oom)
    out.print(f"sweep {sweep_id}: {answer['changed']} run(s) requeued")


@app.command()
@friendly_errors
def cluster() -> None:
    """The Ray cluster the service uses: nodes, CPUs and GPUs, and what is free."""
    from rich.table import Table

    with client() as c:
        info = c.cluster()
    table = Table("node", "ip", "CPUs free/total", "GPUs free/total", "GPU names", box=None)
    for n in info["nodes"]:
        table.add_row(
            n["hostname"],
            n["ip"],
            f"{n['free_cpus']:g}/{n['cpus']:g}",
            f"{n['free_gpus']:g}/{n['gpus']:g}",
            ", ".join(n["gpu_names"]) or "—",
        )
    out.print(table)
    out.print(
        f"total: {info['free_cpus']:g}/{info['total_cpus']:g} CPUs free, "
        f"{info['free_gpus']:g}/{info['total_gpus']:g} GPUs free"
    )


def _safe(settings: Settings) -> str:
    """The database URL with any password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(settings.database_url).render_as_string(hide_password=True)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
