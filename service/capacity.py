"""What the CLI tells about runs the cluster cannot hold, and why runs ended as they did.

`cannot_fit` warns at submit (`dry_run_warnings` at a dry run), with workers.fit.check_feasible
(the check the scheduler refuses a run by) on the cluster /api/v1/cluster describes; `reasons`
gives one line per run that did not end ok (`ringlab results`, `ringlab watch`).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from service.client import ClientError
from service.units import plural
from workers.errors import Infeasible
from workers.fit import check_feasible

LISTED_RUNS = 8
"""Runs named per reason before the rest are counted."""


def capacity_text(cluster: dict[str, Any]) -> str:
    """'2 CPU, 0 GPU on 1 node(s)'."""
    nodes = len(cluster.get("nodes") or [])
    return f"{cluster['total_cpus']:g} CPU, {cluster['total_gpus']:g} GPU on {nodes} node(s)"


def _run_ids(ids: list[int]) -> str:
    """'runs 3, 4, 9' or 'runs 3, 4, 5, … (28 runs)'."""
    shown = ", ".join(str(i) for i in ids[:LISTED_RUNS])
    more = f", … ({len(ids)} runs)" if len(ids) > LISTED_RUNS else ""
    return f"run{'s' if len(ids) > 1 else ''} {shown}{more}"


def _need(cluster: dict[str, Any], device: str, world_size: int, placement: str) -> str | None:
    """What a run placed so needs that this cluster can never give (Infeasible.needed), or
    None when it fits: workers.fit.check_feasible, the scheduler's own check."""
    try:
        check_feasible(
            SimpleNamespace(device=device, world_size=world_size, placement=placement), cluster
        )
    except Infeasible as exc:
        return exc.needed
    return None


def cannot_fit(cluster: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """Warning lines for the runs (as /api/v1/runs lists them) this cluster can never hold:
    the cluster's capacity, then what each group of them needs and their ids; [] when all
    fit."""
    needs: dict[str, list[int]] = defaultdict(list)
    for run in runs:
        cfg = run["config"]
        world = int(cfg.get("world_size", run.get("world_size", 1)))
        need = _need(cluster, cfg.get("device", "auto"), world, cfg.get("placement", "pack"))
        if need is not None:
            needs[need].append(int(run["id"]))
    if not needs:
        return []
    count = sum(len(ids) for ids in needs.values())
    lines = [
        f"warning: {count} of {len(runs)} runs cannot fit this cluster "
        f"({capacity_text(cluster)}); they will fail as infeasible:"
    ]
    lines += [f"  {_run_ids(ids)}: the run needs {need}" for need, ids in needs.items()]
    return lines


def reason(run: dict[str, Any]) -> str:
    """The first line of why a run did not end ok (its error), or its state when none."""
    error = (run.get("error") or "").strip()
    return error.splitlines()[0] if error else str(run.get("status", "?"))


NOT_OK = ("failed", "timed_out", "oom", "cancelled")
"""Run states `reasons` explains."""
STATUS_WORDS = {"succeeded": "ok", "timed_out": "timed out", "waiting_resources": "waiting"}
"""How the results table's status column names a run state."""


def reasons(rows: list[dict[str, Any]]) -> list[str]:
    """'run 12 failed: infeasible: the run needs 4 CPU …', one line per run (a result row or
    a listed run) whose state is in NOT_OK."""
    lines = []
    for row in rows:
        status = str(row.get("status"))
        if status in NOT_OK:
            run_id = row.get("run_id", row.get("id"))
            lines.append(f"run {run_id} {STATUS_WORDS.get(status, status)}: {reason(row)}")
    return lines


MAX_CHECKED_RUNS = 10_000
"""Runs of one sweep `ringlab submit` checks against the cluster (10 pages); beyond, it says so."""


def sweep_runs(
    c: Any, sweep_id: int, status: str | None = None, most: int | None = None
) -> list[dict[str, Any]]:
    """The runs of a sweep (in `status` when given; the first `most` when given), page by page,
    as /api/v1/runs lists them."""
    params: dict[str, Any] = {"sweep_id": sweep_id, "limit": 1000, "sort": "id", "count": False}
    if status is not None:
        params["status"] = status
    runs: list[dict[str, Any]] = []
    while True:
        page = c.request("GET", "/runs", params=params).json()
        runs += page["data"]
        if not page.get("next") or (most is not None and len(runs) >= most):
            return runs[:most]
        params["cursor"] = page["next"]


def _cluster_or_warning(c: Any) -> dict[str, Any] | str:
    """GET /cluster's answer, or the warning line that says the capacity could not be checked
    (the cluster unreachable): what submit's and dry run's warnings start from."""
    try:
        cluster: dict[str, Any] = c.request("GET", "/cluster").json()
    except ClientError as exc:
        return f"warning: the cluster's capacity was not checked: {exc}"
    return cluster


def submit_warnings(c: Any, sweep_ids: list[int]) -> list[str]:
    """What `ringlab submit` warns of: the runs of these sweeps that the cluster can never
    hold (`cannot_fit`), or that the check could not be made when the cluster is unreachable."""
    cluster = _cluster_or_warning(c)
    if isinstance(cluster, str):
        return [cluster]
    lines = []
    for sweep_id in sweep_ids:
        runs = sweep_runs(c, sweep_id, most=MAX_CHECKED_RUNS + 1)
        if len(runs) > MAX_CHECKED_RUNS:
            runs = runs[:MAX_CHECKED_RUNS]
            lines.append(f"sweep {sweep_id}: only its first {len(runs):,} runs were checked")
        found = cannot_fit(cluster, runs)
        if found:
            lines += [f"sweep {sweep_id}: {found[0]}", *found[1:]]
    return lines


def dry_run_warnings(c: Any, documents: list[dict[str, Any]]) -> list[str]:
    """What `ringlab submit --dry-run` warns of: per document of the check, the cells the
    cluster could never hold (counted from its `placed`), as a real submit warns of runs."""
    if not any(doc["placed"] for doc in documents):
        return []
    cluster = _cluster_or_warning(c)
    if isinstance(cluster, str):
        return [cluster]
    lines = []
    for doc in documents:
        needs: dict[str, int] = defaultdict(int)
        for placed in doc["placed"]:
            need = _need(cluster, placed["device"], placed["world_size"], placed["placement"])
            if need is not None:
                needs[need] += placed["cells"]
        if needs:
            lines.append(
                f"documents[{doc['index']}]: warning: {sum(needs.values())} of {doc['cells']} "
                f"cells cannot fit this cluster ({capacity_text(cluster)}); submitted, they "
                "would fail as infeasible:"
            )
            lines += [f"  {plural(n, 'cell')}: the run needs {need}" for need, n in needs.items()]
    return lines


def watch_reasons(c: Any, sweep_ids: list[int]) -> list[str]:
    """Why each run of these sweeps that did not end ok ended so, sweep by sweep: 'sweep 3, run
    12 failed: …' (`reasons`; never 'sweep 3 ', which starts the sweep's progress line)."""
    lines = []
    for sweep_id in sweep_ids:
        runs = [r for s in NOT_OK for r in sweep_runs(c, sweep_id, status=s)]
        lines += [
            f"sweep {sweep_id}, {line}" for line in reasons(sorted(runs, key=lambda r: r["id"]))
        ]
    return lines
