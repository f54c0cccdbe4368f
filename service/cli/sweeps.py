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


def _fit(
    headers: list[str], rows: list[list[str]], width: int
) -> tuple[list[str], list[list[str]]]:
    """The table in `width` columns, each sweep on one line: the name gives way to 24
    characters, then the kind column goes (`show` has it), then the counts give way to 12 and
    the name to 8; a cut name keeps what tells it apart (cut_apart). So a name stays readable
    and a failure stays in sight as long as the terminal allows."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    whole = widths[1]
    if sum(widths) + 2 * len(headers) > width:  # box=None pads each column by 2
        widths[1] = max(min(24, whole), width - 2 * len(headers) - sum(widths) + whole)
    if sum(widths) + 2 * len(headers) > width:
        del headers[2], widths[2]
        rows = [[*r[:2], *r[3:]] for r in rows]
        room = width - 2 * len(headers) - sum(widths) + widths[1]
        widths[1] = max(widths[1], min(whole, room))  # the name takes back what it can
    counts = len(headers) - 1
    for column, least in ((counts, 12), (1, 8)):
        over = sum(widths) + 2 * len(headers) - width
        if over > 0:
            widths[column] = max(min(least, widths[column]), widths[column] - over)
    names = cut_apart([r[1] for r in rows], widths[1])
    for r, name in zip(rows, names, strict=True):
        r[1], r[counts] = name, cut_end(r[counts], widths[counts])
    return headers, rows


@friendly_errors
def list_sweeps(
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20,
) -> None:
    """List sweeps, newest first, with progress and runs by state."""
    with client() as c:
        page = c.sweeps(limit=limit)
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
    headers, rows = _fit(headers, rows, out.width)
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
