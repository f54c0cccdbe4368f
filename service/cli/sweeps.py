"""The commands on stored sweeps over HTTP: `ringlab ls`, `show`, `cancel`, `retry` and
`delete`, and `ringlab cluster` for what the service's Ray holds."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from service.cli.console import CliError, client, err, friendly_errors, out
from service.cli.specs import spec_yaml
from service.cli.text import cut_apart, cut_end, state_counts
from service.client import ClientError
from service.units import plural


@friendly_errors
def list_sweeps(
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20,
) -> None:
    """List sweeps, newest first, with progress and runs by state."""
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
            state_counts(s["counts"]),
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
            r[1], r[5] = name, cut_end(r[5], widths[5])
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


@friendly_errors
def show(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """One sweep: kind, progress, runs by state, its spec and dashboard URL."""
    with client() as c:
        s = c.sweep(sweep_id)
        url = c.dashboard_url(sweep_id)
    out.print(f"[bold]sweep {s['id']}[/bold] {s['name']} ({s['kind']})")
    out.print(f"created {s['created_at'][:19].replace('T', ' ')} UTC")
    out.print(f"progress {s['finished']}/{s['total']}: {state_counts(s['counts'])}")
    out.print(f"dashboard: {url}")
    out.print(spec_yaml(s["spec"]), markup=False)


@friendly_errors
def cancel(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """Cancel the sweep's queued, waiting and running runs."""
    with client() as c:
        answer = c.cancel(sweep_id)
    out.print(f"sweep {sweep_id}: {plural(answer['changed'], 'run')} cancelled")


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


@friendly_errors
def cluster() -> None:
    """The Ray cluster the service uses: nodes, CPUs and GPUs, and what is free."""
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
