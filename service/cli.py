"""The `ringlab` command line (typer + rich). Errors are one readable line and a non-zero exit."""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from service import capacity
from service.cli_base import CliError, app, client, db_app, err, friendly_errors, one_line, out
from service.client import ClientError
from service.core.config import Settings, exposure_problem
from service.units import MS, TimeUnit, duration, plural, time_unit


def load_settings() -> Settings:
    """Settings from the environment; a bad value becomes a CliError-style exit."""
    return Settings()


def _migrate(step: Callable[[str, str], object], revision: str) -> None:
    """Run `step` (migrate.upgrade or downgrade) on the configured database to `revision` and
    print the revision it is at afterwards."""
    from service.db.migrate import current

    settings = load_settings()
    step(settings.database_url, revision)
    out.print(f"database at revision {current(settings.database_url)}: {_safe(settings)}")


@db_app.command("upgrade")
@friendly_errors
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Bring the database (RINGLAB_DATABASE_URL) to the latest schema."""
    from service.db.migrate import upgrade

    _migrate(upgrade, revision)


@db_app.command("downgrade")
@friendly_errors
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' empties it).")],
) -> None:
    """Take the database back to an earlier revision."""
    from service.db.migrate import downgrade

    _migrate(downgrade, revision)


@db_app.command("current")
@friendly_errors
def db_current() -> None:
    """Print the database's current revision."""
    from service.db.migrate import current

    settings = load_settings()
    out.print(current(settings.database_url) or "empty (no revision)")


# ---- processes: the service, a scheduler alone, the demo ----


def bind_listeners(host: str, port: int) -> list[Any]:
    """Listening sockets on every address of host:port, bound the way asyncio binds them
    (SO_REUSEADDR, v6-only); OSError (socket.gaierror included) if one cannot be bound.

    The caller keeps them and hands them to uvicorn: no other process can take the port
    between this check and the server's start (Ray's start-up takes seconds in between)."""
    import socket

    addresses = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
    except OSError:
        for sock in bound:
            sock.close()
        raise
    return bound


def _free(host: str, port: int) -> bool:
    try:
        for sock in bind_listeners(host, port):
            sock.close()
    except OSError:
        return False
    return True


def check_port(host: str, port: int, how: str) -> list[Any]:
    """The listening sockets of host:port, or one line and exit 1 if it cannot be listened on,
    before anything heavy starts.

    `how` says how to pick another port; {port} in it becomes a free one near `port`.
    """
    import errno

    try:
        return bind_listeners(host, port)
    except OSError as problem:
        if problem.errno != errno.EADDRINUSE:
            reason = problem.strerror or str(problem)
            raise CliError(
                f"cannot listen on {host}:{port}: {reason}; {how.format(port='PORT')}"
            ) from problem
    free = next((p for p in range(port + 1, min(port + 50, 65536)) if _free(host, p)), None)
    raise CliError(
        f"port {port} on {host} is in use (another ringlab or server is listening there); "
        + how.format(port=free or "PORT")
    )


def _url(host: str, port: int) -> str:
    """The address a browser on this machine uses for a server bound to host:port."""
    shown = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def _start_serving(settings: Settings, host: str, port: int, how: str) -> list[Any]:
    """What serve and demo do before uvicorn: the port taken (its sockets returned for
    uvicorn), the database URL (password hidden) and dashboard URL printed, the database
    migrated (unreachable: one line)."""
    from service.db.migrate import upgrade

    sockets = check_port(host, port, how)
    out.print(f"dashboard: {_url(host, port)}/")
    out.print(f"database:  {_safe(settings)}")
    upgrade(settings.database_url)
    return sockets


DATABASE_RULE = (
    "Database: RINGLAB_DATABASE_URL, by default SQLite ringlab.db in the user's data dir; "
    "`ringlab serve` and `ringlab demo` use the same one."
)


@app.command(
    help=f"Serve the API and the dashboard; unless --no-scheduler, run the scheduler "
    f"in-process. Prints the dashboard and database URLs first. {DATABASE_RULE}"
)
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
    sockets = _start_serving(settings, host, port, "pick another: ringlab serve --port {port}")
    from service.app import run_server

    run_server(settings, host=host, port=port, with_scheduler=not no_scheduler, sockets=sockets)


@app.command()
@friendly_errors
def scheduler() -> None:
    """Run a scheduler alone (deployments with several API replicas on Postgres)."""
    import signal
    import threading

    from service.db.engine import make_engine, make_sessionmaker
    from service.db.migrate import upgrade
    from service.ray_supervisor import Supervisor

    settings = load_settings()
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    err.print(f"scheduler on {_safe(settings)}; SIGTERM or Ctrl-C stops it cleanly")
    # Ray lives in a driver process this one supervises: losing Ray never ends this process.
    try:
        Supervisor(settings, make_sessionmaker(engine), schedule=True).run(stop)
    finally:
        engine.dispose()


DEMO_EXAMPLE = "cpu-quick.yaml"


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
    from service.client import Client

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
    from platformdirs import user_data_dir

    log_file = access_log or Path(user_data_dir("ringlab")) / "demo-access.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    return log_file


@app.command(
    help="Start the service with a local CPU Ray, submit cpu-quick.yaml, keep serving until "
    f"Ctrl-C. Prints the dashboard and database URLs first. {DATABASE_RULE}"
)
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
    import os
    import signal
    import threading

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
    sockets = _start_serving(settings, "127.0.0.1", port, how)
    log_file = _demo_access_log(access_log)
    out.print(f"starting ringlab on {base} with a local Ray on CPU")
    out.print(f"access log: {log_file} (each page view; ringlab demo --access-log PATH)")
    from service.app import run_server

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
        f"[bold]demo sweep {sweep_id} ended[/bold] ({_counts(s['counts'])}): "
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


# ---- client commands: talk to a running service over HTTP ----


def bundled_examples() -> dict[str, Any]:
    """The example sweeps shipped in the package (service.examples = examples/*.yaml), by name."""
    from importlib.resources import files

    folder = files("service.examples")
    found = (f for f in folder.iterdir() if f.name.endswith(".yaml") and f.is_file())
    return {f.name.removesuffix(".yaml"): f for f in sorted(found, key=lambda f: f.name)}


def _bundled(file: str) -> tuple[str, str]:
    """(label, text) of the bundled example `file` names: `cpu-quick` or `cpu-quick.yaml`."""
    import difflib

    examples = bundled_examples()
    path = Path(file)
    name = path.name.removesuffix(".yaml").removesuffix(".yml")
    # `examples/x.yaml` as the README writes it also works outside a checkout.
    if str(path.parent) in (".", "examples") and name in examples:
        return f"{name}.yaml (bundled)", examples[name].read_text()
    close = difflib.get_close_matches(name, examples, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise CliError(
        f"{file}: no such file, nor a bundled example of that name; {hint}"
        f"bundled examples: {', '.join(examples)}"
    )


def _yaml_error(label: str, text: str, e: Exception) -> CliError:
    """`file:line:column: problem` and the offending line, from a PyYAML error."""
    import yaml

    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return CliError(f"{label}: not valid YAML: {str(e).splitlines()[0]}")
    mark, context = e.problem_mark, e.context_mark
    message = f"{label}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {e.problem}"
    if e.context and context is not None:
        message += f" ({e.context} at line {context.line + 1}, column {context.column + 1})"
    # The line to look at: where the unclosed bracket or quote opened, else where parsing stopped.
    lines = text.splitlines()
    at = context if context is not None and context.line < len(lines) else mark
    shown = lines[at.line] if at.line < len(lines) else ""
    return CliError(message, detail=f"  {at.line + 1} | {shown}" if shown.strip() else None)


def load_specs(file: str) -> list[dict[str, Any]]:
    """The sweep specs of a YAML file (one per document), or of a bundled example by name
    (`cpu-quick` or `cpu-quick.yaml`)."""
    import yaml

    path = Path(file)
    if path.is_file():
        label, text = file, path.read_text()
    else:
        label, text = _bundled(file)
    try:
        specs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as e:
        raise _yaml_error(label, text, e) from None
    if not specs:
        raise CliError(f"{label}: no sweep spec in it")
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise CliError(
                f"{label}: document {i + 1} is not a mapping (name, kind, base, grid...)"
            )
    return specs


@app.command()
@friendly_errors
def submit(
    file: Annotated[
        str,
        typer.Argument(
            help="Sweep spec (YAML), or a bundled example's name (e.g. cpu-quick; a wrong "
            "name lists them)."
        ),
    ],
    watch_: Annotated[
        bool,
        typer.Option(
            "--watch", help="Follow every sweep of the file until all end; exit 1 if a run failed."
        ),
    ] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submitting again with the same key returns the same sweep.")
    ] = None,
    print_id: Annotated[
        bool,
        typer.Option(
            "--print-id", help="Print only each sweep's id, one a line: id=$(ringlab submit ...)."
        ),
    ] = False,
    as_: Annotated[
        str | None,
        typer.Option(
            "--as",
            envvar="RINGLAB_SUBMITTER",
            help="Submit as this name (default: your login name): the queue round-robins "
            "across submitters, then across each one's sweeps.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check every document and print its cell count and problems; store nothing "
            "(exit 1 if a document has a problem).",
        ),
    ] = False,
) -> None:
    """Submit a sweep per YAML document, all of them or none; print each id and dashboard URL."""
    if print_id and watch_:
        raise CliError("--print-id and --watch: pick one (ringlab watch $id follows it)")
    specs = load_specs(file)
    with client() as c:
        if dry_run:
            _dry_run(c, file, specs)
            return
        sweeps = _submit_all(c, file, specs, idempotency_key, as_)
        for sweep in sweeps:
            if print_id:
                out.print(str(sweep["id"]))
                continue
            out.print(f"sweep {sweep['id']} ({sweep['name']}): {plural(sweep['total'], 'run')}")
            out.print(f"dashboard: {c.dashboard_url(sweep['id'])}")
        ids = [sweep["id"] for sweep in sweeps]
        capacity.warn_at_submit(c, ids)
        if watch_:
            _watch(c, ids)


def problem_path(loc: list[Any]) -> str:
    """A 422 error's loc as a path: ['body', 'documents', 1, 'grid', 'seq_len', 0] ->
    'documents[1].grid.seq_len[0]'."""
    path = ""
    for part in loc[1:] if loc[:1] == ["body"] else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _problem_lines(errors: list[dict[str, Any]]) -> str:
    """A line per problem: '  documents[1].grid.seq_len[0]: msg'."""
    return "\n".join(f"  {problem_path(e.get('loc', []))}: {e.get('msg')}" for e in errors)


def _submit_all(
    c: Any, file: str, specs: list[dict[str, Any]], key: str | None, who: str | None
) -> list[dict[str, Any]]:
    """One document as a single sweep; several in one request, stored all or none (a
    CliError listing every document's problems, nothing stored)."""
    if len(specs) == 1:
        return [c.submit(specs[0], idempotency_key=key, submitter=who)]
    try:
        return list(c.submit_documents(specs, idempotency_key=key, submitter=who))
    except ClientError as e:
        if e.status != 422 or not e.errors:
            raise
        n = len(e.errors)
        raise CliError(
            f"{file}: nothing submitted: {plural(n, 'problem')} in its "
            f"{len(specs)} documents; fix them and submit again",
            detail=_problem_lines(e.errors),
        ) from None


def _dry_run(c: Any, file: str, specs: list[dict[str, Any]]) -> None:
    """Each document's cell count and problems, as the service would store it; exit 1 if
    any document has a problem."""
    check = c.check(specs)
    for doc in check["documents"]:
        name = f" ({doc['name']})" if doc["name"] else ""
        cells = "?" if doc["cells"] is None else f"{doc['cells']:,}"
        verdict = plural(len(doc["problems"]), "problem") if doc["problems"] else "ok"
        out.print(f"document {doc['index'] + 1}{name}: {cells} cells, {verdict}", markup=False)
        if doc["problems"]:
            out.print(_problem_lines(doc["problems"]), markup=False)
    out.print(f"{file}: dry run, nothing stored", markup=False)
    if not check["valid"]:
        raise typer.Exit(1)


FAILED_STATES = ("failed", "timed_out")


def _follow(c: Any, sweep_id: int, events: queue.Queue[tuple[int, str, dict[str, Any]]]) -> None:
    """Put the sweep's events on `events` (a thread per sweep), then `closed` or `error`."""
    try:
        for event, data in c.events(sweep_id):
            events.put((sweep_id, event, data))
            if event == "end":
                return
        events.put((sweep_id, "closed", {}))
    except Exception as e:  # shown as the sweep's one-line problem by the watching thread
        events.put((sweep_id, "error", {"message": one_line(e)}))


def _live_counts(counts: dict[str, int]) -> str:
    """A progress line's counts: running and failed always, other unusual states when any."""
    failed = sum(counts.get(s, 0) for s in FAILED_STATES)
    parts = [f"running {counts.get('running', 0)}", f"failed {failed}"]
    unusual = {"waiting_resources": "waiting", "oom": "oom", "cancelled": "cancelled"}
    parts += [f"{short} {counts[state]}" for state, short in unusual.items() if counts.get(state)]
    return ", ".join(parts)


def _follow_all(c: Any, sweep_ids: list[int]) -> queue.Queue[tuple[int, str, dict[str, Any]]]:
    """One queue fed by a `_follow` thread per sweep."""
    import threading

    events: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
    for sweep_id in sweep_ids:
        threading.Thread(
            target=_follow, args=(c, sweep_id, events), name=f"watch-{sweep_id}", daemon=True
        ).start()
    return events


class _Watcher:
    """The progress lines of the watched sweeps, moved by their events: which sweeps ended
    and which have a problem (deleted, a stream closed early, an error) instead."""

    def __init__(
        self, c: Any, sweeps: dict[int, dict[str, Any]], progress: Any, names: dict[int, str]
    ) -> None:
        self.c = c
        self.sweeps = sweeps
        self.progress = progress
        self.problems: dict[int, str] = {}
        self.ended: list[int] = []
        self.tasks = {
            sweep_id: progress.add_task(
                escape(names[sweep_id] if len(sweeps) > 1 else f"sweep {sweep_id}"),
                total=s["total"],
                completed=s["finished"],
                counts=_live_counts(s["counts"]),
            )
            for sweep_id, s in sweeps.items()
        }

    def watching(self) -> bool:
        """Whether some sweep has neither ended nor a problem."""
        return len(self.ended) + len(self.problems) < len(self.sweeps)

    def handle(self, sweep_id: int, event: str, data: dict[str, Any]) -> None:
        """One event of one sweep's stream (see `_follow`)."""
        if event == "end" and data.get("deleted"):
            self.problems[sweep_id] = f"sweep {sweep_id} was deleted while watching"
            return
        if event == "closed":  # the stream closed early (a restart, a proxy): ask
            data = self.c.sweep(sweep_id)
            if not data["done"]:
                self.problems[sweep_id] = (
                    f"the event stream of sweep {sweep_id} closed before the sweep ended "
                    f"({data['finished']}/{data['total']} finished); watch it again: "
                    f"ringlab watch {sweep_id}"
                )
                return
            event = "end"
        if event == "error":
            self.problems[sweep_id] = data["message"]
            return
        if event == "run" and data.get("last_probe"):  # a search's probes, as they come
            probe = data["last_probe"]
            self.progress.console.print(
                f"sweep {sweep_id} run {data['id']}: probe {data['probes']}, "
                f"{probe['seq_len']:,} tokens {probe['outcome']}",
                markup=False,
            )
        if event in ("progress", "end") and "counts" in data:
            self.sweeps[sweep_id] = data
            self.progress.update(
                self.tasks[sweep_id],
                total=data["total"],
                completed=data["finished"],
                counts=_live_counts(data["counts"]),
            )
        if event == "end":
            self.ended.append(sweep_id)


def _print_ended(
    c: Any, sweeps: dict[int, dict[str, Any]], kinds: dict[int, str], ended: list[int]
) -> None:
    """A line per ended sweep with its counts; a search's answers under it."""
    for sweep_id in sweeps:
        if sweep_id in ended:
            out.print(f"sweep {sweep_id} ended: {_counts(sweeps[sweep_id]['counts'])}")
            if sweeps[sweep_id].get("kind", kinds.get(sweep_id)) == "max_seq_len":
                for line in search_answers(c, sweep_id):
                    out.print(line, markup=False)


def _watch_exit(
    sweeps: dict[int, dict[str, Any]], ended: list[int], problems: dict[int, str]
) -> None:
    """Say how many runs failed or timed out; CliError with the problems, else exit 1 if
    any run failed."""
    bad = {i: sum(sweeps[i]["counts"].get(s, 0) for s in FAILED_STATES) for i in ended}
    failing = [i for i, n in bad.items() if n]
    if failing:
        how = "; ".join(f"ringlab results {i}" for i in failing)
        err.print(f"[red]{plural(sum(bad.values()), 'run')} failed or timed out[/red]: {how}")
    if problems:
        raise CliError("; ".join(problems[i] for i in sweeps if i in problems))
    if failing:
        raise typer.Exit(1)


def _watch(c: Any, sweep_ids: list[int]) -> None:
    """One progress display with a line per sweep (runs done/total, running, failed), fed by
    each sweep's event stream, until every sweep ends; exit 1 if any run failed or timed out."""
    from rich.progress import Progress

    sweeps = {sweep_id: c.sweep(sweep_id) for sweep_id in dict.fromkeys(sweep_ids)}
    sweep_kinds = {sweep_id: s["kind"] for sweep_id, s in sweeps.items()}
    events = _follow_all(c, list(sweeps))
    names, columns = _watch_columns({i: s["name"] for i, s in sweeps.items()})
    with Progress(*columns, console=err, transient=False) as progress:
        watcher = _Watcher(c, sweeps, progress, names)
        while watcher.watching():
            watcher.handle(*events.get())
    _print_ended(c, sweeps, sweep_kinds, watcher.ended)
    capacity.print_watch_reasons(c, sweeps, watcher.ended)
    _watch_exit(sweeps, watcher.ended, watcher.problems)


def _watch_columns(names: dict[int, str]) -> tuple[dict[int, str], tuple[Any, ...]]:
    """The progress lines' names and columns. The numbers keep their width in an 80-column
    terminal; long sweep names lose the words they share, then their ends ("…"), and never
    shrink below what tells them apart."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    bar = 10 if err.width < 100 else 30
    room = max(16, err.width - bar - 40)
    shown = watch_names(names, room)
    name = Column(
        no_wrap=True,
        overflow="ellipsis",
        max_width=room,
        min_width=min(room, max(len(n) for n in shown.values())),
    )
    columns = (
        TextColumn("[bold]{task.description}", table_column=name),
        BarColumn(bar_width=bar),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TextColumn("{task.fields[counts]}", table_column=Column(overflow="fold")),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
    )
    return shown, columns


def watch_names(names: dict[int, str], room: int) -> dict[int, str]:
    """Each sweep's progress-line name, "sweep 2 <name>": whole when every one fits in `room`;
    else without the words all the names share ("sweep 2 …dense", "sweep 3 …block_sparse"),
    so a cut end never leaves two alike (cpu max-seq-len 1 rank - dense / - dilated)."""
    whole = {i: f"sweep {i} {n}" for i, n in names.items()}
    if len(names) < 2 or all(len(n) <= room for n in whole.values()):
        return whole
    split = [n.split(" ") for n in names.values()]
    shared = 0
    while all(len(w) > shared + 1 and w[shared] == split[0][shared] for w in split):
        shared += 1
    return {
        i: f"sweep {i} " + ("…" if shared else "") + " ".join(n.split(" ")[shared:])
        for i, n in names.items()
    }


def search_answers(c: Any, sweep_id: int) -> list[str]:
    """A max_seq_len sweep's answers, a line per run: "sweep 2 run 5 dense: max 31,744
    tokens, 46 s" (the search's wall-clock time), or why there is none."""
    from datetime import datetime

    rows = c.results(sweep_id)
    runs = c.request("GET", "/runs", params={"sweep_id": sweep_id, "limit": 500}).json()["data"]
    spans = {}
    for r in runs:
        if r.get("started_at") and r.get("finished_at"):
            start, end = (datetime.fromisoformat(r[k]) for k in ("started_at", "finished_at"))
            spans[r["id"]] = f", {duration((end - start).total_seconds())}"
    lines = []
    for row in rows:
        head = f"sweep {sweep_id} run {row['run_id']} {row['label']}: "
        span = spans.get(row["run_id"], "")
        if row.get("max_seq_len"):
            lines.append(f"{head}max {row['max_seq_len']:,} tokens{span}")
        elif row["status"] != "succeeded" and row.get("error"):  # e.g. "infeasible: …"
            lines.append(f"{head}{capacity.reason(row)}")
        else:
            state = "" if row["status"] == "succeeded" else f" ({row['status']})"
            lines.append(f"{head}no length fit{state}{span}")
    return lines


def _counts(counts: dict[str, int]) -> str:
    """Runs by state: "succeeded 3, failed 1, waiting 2" (waiting: for resources)."""
    named = ((STATE_WORDS.get(state, state), n) for state, n in counts.items() if n)
    return ", ".join(f"{state} {n}" for state, n in named) or "no runs"


STATE_WORDS = {"waiting_resources": "waiting", "timed_out": "timed out"}
"""How a terminal line names a run state."""


def _cut(text: str, width: int) -> str:
    """The text in `width` characters, its end cut to "…" when it is longer."""
    return text if len(text) <= width else text[: width - 1] + "…"


def cut_apart(names: Sequence[str], width: int) -> list[str]:
    """Each name in `width` characters, still told apart: whole when it fits; cut at its end
    ("…") when no other name cuts alike; else its head and tail around "…" ("cpu…- dense"),
    or its tail alone, the first of these that no other cut name shares."""
    ends = [_cut(n, width) for n in names]
    shown = []
    for name, end in zip(names, ends, strict=True):
        alike = [n for n, e in zip(names, ends, strict=True) if e == end and n != name]
        if len(name) <= width or not alike:
            shown.append(end)
            continue
        head = max(1, (width - 1) // 3)
        for keep in (head, 0):  # head and tail, then the tail alone
            cut = name[:keep] + "…" + name[len(name) - (width - 1 - keep) :]
            if all(cut != n[:keep] + "…" + n[len(n) - (width - 1 - keep) :] for n in alike):
                break
        shown.append(cut)
    return shown


@app.command()
@friendly_errors
def watch(
    sweep_ids: Annotated[
        list[int], typer.Argument(metavar="SWEEP_ID", help="Sweep ids (one or more).")
    ],
    patience: Annotated[
        float,
        typer.Option(
            min=0,
            max=86_400,
            help="Seconds to keep trying while the service or its database is unavailable "
            "(honouring Retry-After) before giving up.",
        ),
    ] = 120.0,
) -> None:
    """Follow sweeps with a progress line each until all end; exit 1 if any run failed or
    timed out."""
    with client() as c:
        c.patience_s = patience
        c.on_wait = lambda line: err.print(line, style="dim", markup=False)
        _watch(c, sweep_ids)


@app.command("ls")
@friendly_errors
def list_sweeps(
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20,
) -> None:
    """List sweeps, newest first, with progress and runs by state."""
    from rich.table import Table

    with client() as c:
        page = c.sweeps(limit=limit)
    # A row stays on one line at 80 columns: id, kind, creation minute, progress and the
    # counts never wrap; a long name is cut at its end ("…") first.
    rows = [
        [
            str(s["id"]),
            s["name"],
            s["kind"],
            s["created_at"][5:16].replace("T", " "),
            f"{s['finished']}/{s['total']}",
            _counts(s["counts"]),
        ]
        for s in page["data"]
    ]
    headers = ["id", "name", "kind", "created UTC", "done", "runs by state"]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    spare = out.width - 2 * len(headers) - sum(widths)  # box=None pads each column by 2
    if spare < 0:  # the name gives way first (to 8 characters), then the counts
        widths[1] = max(8, widths[1] + spare)
        widths[5] = max(12, out.width - 2 * len(headers) - sum(widths[:5]))
        names = cut_apart([r[1] for r in rows], widths[1])
        for r, name in zip(rows, names, strict=True):
            r[1], r[5] = name, _cut(r[5], widths[5])
    table = Table(box=None)
    for header in headers:
        right = header in ("id", "done")
        table.add_column(header, no_wrap=True, justify="right" if right else "left")
    for row in rows:
        table.add_row(*row)
    out.print(table)
    if page["next"] is not None:
        total = f"{page['count']:,}" + ("" if page["count_exact"] else "+")
        out.print(f"[dim]{len(page['data'])} of {total} sweeps (--limit)[/dim]")


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
    ("status", "status"),
    ("length", "length"),
    ("median_s", "time"),
    ("tokens_per_s", "tokens/s"),
    ("peak_memory_bytes", "peak mem"),
    ("exposed_comm_share", "comm"),
    ("max_seq_len", "max len"),
    ("baseline", "vs"),
    ("speedup", "speedup"),
)
"""The terminal table: the label already names the world size, parallel mode and dtype where
they vary; a run without a time shows its status there; a speedup within noise carries ~,
one above its physical limit ⚠ with the reason below the table; every other number is in
--format csv/json. A column no row has a value for is left
out, so the table fits an 80-column terminal."""


BASELINE_TEXT = 24
"""A baseline named by more characters than this shows as its run id in the terminal table."""


def _cell(key: str, value: Any, unit: TimeUnit = MS) -> str:
    if value is None:
        return "—"
    if key == "speedup":
        return f"{value:.2f}x"
    if key == "status":  # the reason of each run not ok is printed below the table
        return capacity.STATUS_WORDS.get(value, value)
    if key == "exposed_comm_share":  # ring runs: time blocked on transfers / time in steps
        return f"{value:.0%}"
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "median_s":  # one unit for the whole column, as in report.md
        return unit(value)
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
    unit = time_unit(row.get("median_s") for row in rows)
    table = Table(box=None, pad_edge=False, collapse_padding=True)
    for key, title in shown:
        wraps = key == "label"
        table.add_column(title, no_wrap=not wraps, overflow="fold", min_width=16 if wraps else None)
    for row in rows:
        if row.get("baseline") and len(row["baseline"]) > BASELINE_TEXT:  # several changes
            row["baseline"] = f"run {row['baseline_run_id']}"  # `ringlab report` names them
        cells = [_cell(key, row.get(key), unit) for key, _ in shown]
        if ("speedup", "speedup") in shown and row.get("speedup") is not None:
            cells[shown.index(("speedup", "speedup"))] += _speedup_note(row)
        table.add_row(*cells)
    out.print(table)
    for line in capacity.reasons(rows):  # every run not ok, with its one-line reason
        out.print(line, markup=False, highlight=False, soft_wrap=False)
    if any(_speedup_note(row) == " ~" for row in rows if row.get("speedup") is not None):
        out.print(NOISE_LEGEND, markup=False, highlight=False)
    for row in rows:  # a number above its physical limit is never shown without why
        for flag in row.get("flags") or []:
            out.print(f"⚠ run {row['run_id']}: {flag['text']}", markup=False, highlight=False)


NOISE_LEGEND = ("~ within noise: the speedup's interval (from both runs' median intervals) "
                "holds 1.00x; the two runs cannot be told apart")  # fmt: skip
"""What `~` beside a speedup means, printed under the table whenever one shows."""


def _speedup_note(row: dict[str, Any]) -> str:
    """' ⚠' beside a flagged speedup (explained below the table), ' ~' beside one whose
    interval holds 1.0 (within noise)."""
    if any(f["field"] == "speedup" for f in row.get("flags") or []):
        return " ⚠"
    return " ~" if "speedup" in (row.get("within_noise") or []) else ""


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
    out.print(f"sweep {sweep_id}: {plural(answer['changed'], 'run')} cancelled")


@app.command()
@friendly_errors
def retry(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    include_oom: Annotated[
        bool, typer.Option(help="Also requeue runs that ran out of memory.")
    ] = False,
    cancelled: Annotated[
        bool,
        typer.Option(
            "--cancelled/--no-cancelled",
            help="Requeue cancelled runs too, so `ringlab cancel N; ringlab retry N` resumes "
            "a sweep; --no-cancelled leaves them cancelled.",
        ),
    ] = True,
) -> None:
    """Put the sweep's failed, timed-out and cancelled runs back in the queue (oom ones with
    --include-oom); their partial results are removed."""
    with client() as c:
        answer = c.retry(sweep_id, include_oom=include_oom, include_cancelled=cancelled)
    out.print(f"sweep {sweep_id}: {plural(answer['changed'], 'run')} requeued")


@app.command()
@friendly_errors
def delete(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
) -> None:
    """Delete a sweep with its runs and results (asks first unless --yes). A sweep with runs
    still running must be cancelled first (`ringlab cancel N`)."""
    with client() as c:
        sweep = c.sweep(sweep_id)
        what = f"sweep {sweep_id} ({sweep['name']}, {plural(sweep['total'], 'run')})"
        if not yes:
            err.print(f"Delete {what} and its results? [y/N] ", end="", markup=False)
            answer = sys.stdin.readline()  # "" at end of input: no
            if not sys.stdin.isatty():  # a piped answer is not echoed: end the question's line
                err.print()
            if answer.strip().lower() not in ("y", "yes"):
                raise CliError(f"sweep {sweep_id} not deleted; answer y, or pass --yes")
        try:
            c.delete(sweep_id)
        except ClientError as e:
            if e.status == 409:
                raise CliError(
                    f"sweep {sweep_id} has running or waiting runs; cancel it first: "
                    f"ringlab cancel {sweep_id}"
                ) from None
            raise
    out.print(f"deleted {what}")


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
    idle = [
        f"{n:g} {unit}{'' if n == 1 else 's'}"
        for n, unit in ((info["idle_gang_cpus"], "CPU"), (info["idle_gang_gpus"], "GPU"))
        if n
    ]
    if idle:  # before the total line, which scripts read last
        out.print(
            f"held by idle warm gangs: {' and '.join(idle)} (the next run of the same shape "
            "reuses them; any other run gets them back)"
        )
    out.print(
        f"total: {info['free_cpus']:g}/{info['total_cpus']:g} CPUs free, "
        f"{info['free_gpus']:g}/{info['total_gpus']:g} GPUs free"
    )


def _safe(settings: Settings) -> str:
    """The database URL with any password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(settings.database_url).render_as_string(hide_password=True)


# The commands of their own modules register on `app` (kept apart to keep this file small).
from service import cli_kernels, cli_results  # noqa: E402, F401


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    # `python -m service.cli`: run the app of the module imported as service.cli, the one the
    # commands of service.cli_results registered on (not this __main__ copy's).
    from service.cli import main as imported_main

    imported_main()
