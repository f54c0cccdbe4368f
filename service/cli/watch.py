"""`ringlab watch` (and `submit --watch`): a progress line per sweep, fed by each sweep's event
stream, until every sweep ends; then a line per ended sweep, why runs did not end ok, and a
search's answers."""

from __future__ import annotations

import queue
import threading
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from service import capacity
from service.cli.console import CliError, client, err, friendly_errors, one_line, out
from service.cli.text import state_counts
from service.units import duration, plural


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
        watch_sweeps(c, sweep_ids)


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
            out.print(f"sweep {sweep_id} ended: {state_counts(sweeps[sweep_id]['counts'])}")
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


def watch_sweeps(c: Any, sweep_ids: list[int]) -> None:
    """One progress display with a line per sweep (runs done/total, running, failed), fed by
    each sweep's event stream, until every sweep ends; exit 1 if any run failed or timed out."""
    sweeps = {sweep_id: c.sweep(sweep_id) for sweep_id in dict.fromkeys(sweep_ids)}
    sweep_kinds = {sweep_id: s["kind"] for sweep_id, s in sweeps.items()}
    events = _follow_all(c, list(sweeps))
    names, columns = _watch_columns({i: s["name"] for i, s in sweeps.items()})
    with Progress(*columns, console=err, transient=False) as progress:
        watcher = _Watcher(c, sweeps, progress, names)
        while watcher.watching():
            watcher.handle(*events.get())
    _print_ended(c, sweeps, sweep_kinds, watcher.ended)
    print_watch_reasons(c, sweeps, watcher.ended)
    _watch_exit(sweeps, watcher.ended, watcher.problems)


def print_watch_reasons(c: Any, sweeps: dict[int, dict[str, Any]], ended: list[int]) -> None:
    """Print on stderr why each run that did not end ok ended so, for the ended sweeps whose
    counts (as `ringlab watch` holds them) show any."""
    bad = [i for i in ended if any(sweeps[i]["counts"].get(s) for s in capacity.NOT_OK)]
    for line in capacity.watch_reasons(c, bad):
        err.print(line, markup=False, highlight=False, soft_wrap=False)


def _watch_columns(names: dict[int, str]) -> tuple[dict[int, str], tuple[Any, ...]]:
    """The progress lines' names and columns. The numbers keep their width in an 80-column
    terminal; long sweep names lose the words they share, then their ends ("…"), and never
    shrink below what tells them apart."""
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
    tokens (the search took 46 s)", or why there is none."""
    rows = c.results(sweep_id)
    runs = c.request("GET", "/runs", params={"sweep_id": sweep_id, "limit": 500}).json()["data"]
    spans = {}
    for r in runs:
        if r.get("started_at") and r.get("finished_at"):
            start, end = (datetime.fromisoformat(r[k]) for k in ("started_at", "finished_at"))
            spans[r["id"]] = f" (the search took {duration((end - start).total_seconds())})"
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
