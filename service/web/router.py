"""The dashboard: server-rendered pages (Jinja2) with Plotly charts, served by the service itself.

plotly.js comes from the plotly Python package's own data, so nothing is fetched from outside.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import plotly
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.background import BackgroundTask

from service import history, units
from service.api import store
from service.api.deps import (
    MAX_ID,
    MAX_SKIP,
    RunId,
    SessionDep,
    SweepId,
    require_read_page,
)
from service.api.outputs import artifact_out
from service.api.pages import query_error
from service.api.routes.cells import cell_config
from service.api.schemas import SweepOut
from service.db.models import TERMINAL_STATUSES, Sweep
from service.results import charts, compare, export, queries
from service.results import service as sweep_results
from service.results.stored import StoredStep
from service.web import login
from service.web.render import HERE, STATIC_FILES, page_chunks
from service.web.render import page as _page

PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_read_page)])
"""The pages: data, behind the read check (a browser without a session goes to /login)."""
public = APIRouter(include_in_schema=False)
"""Static files (code, no data) and the login page: reachable before logging in."""


def _friendly(page: Callable[..., Response]) -> Callable[..., Response]:
    """A page whose 404 (no such sweep or run) is an HTML page saying so, with a link back to
    the sweeps, not the API's JSON."""

    @functools.wraps(page)
    def wrapper(request: Request, *args: Any, **kwargs: Any) -> Response:
        try:
            return page(request, *args, **kwargs)
        except HTTPException as e:
            if e.status_code != 404:
                raise
            return _page(request, "not_found.html", status_code=404, detail=str(e.detail))

    return wrapper


@public.get("/static/plotly.min.js")
def plotly_js() -> FileResponse:
    """plotly.js from the installed plotly package (no CDN: clusters are often offline)."""
    return FileResponse(PLOTLY_JS, media_type="text/javascript")


@public.get("/static/{name}")
def static_file(name: str) -> FileResponse:
    """The dashboard's own script and style sheet (a fixed list: no path traversal)."""
    if name not in STATIC_FILES:
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(HERE / "static" / name, media_type=STATIC_FILES[name])


def _summary(s: SweepOut) -> dict[str, Any]:
    """A sweep as the pages show it: counts of the states it has runs in, progress."""
    return {
        "id": s.id,
        "name": s.name,
        "kind": s.kind,
        "created_at": s.created_at,
        "counts": {state: n for state, n in s.counts.items() if n},
        "total": s.total,
        "done": s.finished,
        "finished": s.done,
        "progress": s.progress,
    }


def _summary_or_404(session: SessionDep, sweep_id: int) -> dict[str, Any]:
    out = store.load_sweep_out(session, sweep_id)
    if out is None:
        raise HTTPException(404, f"no sweep {sweep_id}")
    return _summary(out)


@router.get("/", response_class=HTMLResponse)
def sweeps_page(
    request: Request,
    session: SessionDep,
    page: Annotated[int, Query(ge=1, le=MAX_ID)] = 1,
    per_page: Annotated[int, Query(ge=1, le=500)] = 50,
) -> HTMLResponse:
    """Every sweep, newest first: kind, created, progress and run counts by state. Pages are
    offsets (at most MAX_SKIP runs deep, as for the API's `skip`)."""
    if (page - 1) * per_page > MAX_SKIP:
        raise query_error(
            "page", f"at most {MAX_SKIP:,} sweeps deep; GET /api/v1/sweeps pages by cursor"
        )
    found = store.list_sweeps(
        session, skip=(page - 1) * per_page, limit=per_page, kind=None, name=None
    )
    # Beyond the count's cap the page count is unknown: "page 3 of 200+", and "older" follows
    # whether a next page exists.
    assert found.count is not None  # list_sweeps always counts (only run pages may skip it)
    pages = max(1, -(-found.count // per_page))
    return _page(
        request,
        "sweeps.html",
        sweeps=[_summary(s) for s in found.data],
        total=f"{found.count:,}" + ("" if found.count_exact else "+"),
        page=page,
        per_page=per_page,
        pages=f"{pages:,}" + ("" if found.count_exact else "+"),
        has_older=found.next is not None,
    )


@router.get("/sweeps")
def sweeps_redirect(request: Request) -> RedirectResponse:
    """/sweeps typed into the browser: the list lives at /; the query (?page=2) goes along.

    No clash with the API: its list is /api/v1/sweeps. 307 keeps the method and is not cached
    for good, so / can move later.
    """
    query = request.url.query
    return RedirectResponse(f"/?{query}" if query else "/", status_code=307)


WHOLE_SWEEP_RUNS = 2_000
"""Sweeps up to this size come whole (every row, and charts over them); larger ones a page at
a time without charts (report.md has their tables), so no read grows with the sweep."""
PAGE_RUNS = 500
"""Rows per page of a larger sweep."""
MAX_CHANGED_RUNS = 200


def _sweep_payload(
    session: SessionDep,
    sweep_id: int,
    *,
    after: int = 0,
    run_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The sweep page's data: its summary and rows (all of them, a page after run `after`,
    or the runs `run_ids`), `next` (where the next page starts, or null), and figures over
    the whole sweep when it is small enough to have them (else null)."""
    summary = {**_summary_or_404(session, sweep_id)}
    summary["created_at"] = summary["created_at"].isoformat()
    sweep = session.get(Sweep, sweep_id)
    assert sweep is not None  # for mypy: _summary_or_404 found it
    whole = summary["total"] <= WHOLE_SWEEP_RUNS
    limit = None if whole else PAGE_RUNS
    page = queries.rows_page(session, sweep, after=after, limit=limit, run_ids=run_ids)
    rows = [r.as_dict() for r in page]
    more = run_ids is None and limit is not None and len(page) == limit
    figures = scaling = None
    if whole:
        everything = page if run_ids is None and after == 0 else None
        if everything is None:
            everything = queries.rows_page(session, sweep)
        figures = charts.sweep_figures(everything)
        scaling = charts.scaling_table(everything)
    return {
        "sweep": summary,
        "rows": rows,
        "next": page[-1].run_id if more else None,
        "figures": figures,
        "scaling": scaling,
        "whole": whole,
        "page_runs": PAGE_RUNS,
    }


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
@_friendly
def sweep_page(request: Request, session: SessionDep, sweep_id: SweepId) -> HTMLResponse:
    """Results table and charts of one sweep; live while it runs."""
    payload = _sweep_payload(session, sweep_id)
    return _page(
        request,
        "sweep.html",
        payload=payload,
        sweep=payload["sweep"],
        whole_sweep_runs=WHOLE_SWEEP_RUNS,
    )


@router.get("/sweeps/{sweep_id}/dashboard.json")
def sweep_data(
    session: SessionDep,
    sweep_id: SweepId,
    after: Annotated[
        int, Query(ge=0, le=MAX_ID, description="The `next` of the previous page.")
    ] = 0,
    runs: Annotated[
        str | None,
        Query(
            max_length=MAX_CHANGED_RUNS * 11,
            pattern=r"^\d{1,10}(,\d{1,10})*$",
            description=f"Only these runs (comma-separated ids, at most {MAX_CHANGED_RUNS}).",
        ),
    ] = None,
) -> JSONResponse:
    """The sweep page's data (summary, rows, figures). Live, the page asks only for the runs
    an event named as changed (`runs=`); a large sweep's rows come a page at a time
    (`after=`)."""
    run_ids = None
    if runs is not None:
        run_ids = [int(i) for i in runs.split(",")]
        problem = None
        if len(run_ids) > MAX_CHANGED_RUNS:
            problem = f"at most {MAX_CHANGED_RUNS} run ids, got {len(run_ids)}"
        elif max(run_ids) > MAX_ID:
            problem = f"run ids are at most {MAX_ID}, got {max(run_ids)}"
        if problem is not None:
            raise query_error("runs", problem)
    return JSONResponse(_sweep_payload(session, sweep_id, after=after, run_ids=run_ids))


@router.get("/runs/{run_id}", response_class=HTMLResponse)
@_friendly
def run_page(request: Request, session: SessionDep, run_id: RunId) -> HTMLResponse:
    """One run: config, per-rank timings and memory, probes, environment, error."""
    found = queries.one_run(session, run_id)
    if found is None:
        raise HTTPException(404, f"no run {run_id}")
    run, row = found
    figure = charts.rank_times_figure(row.ranks)
    steps = [StoredStep.model_validate(s) for s in queries.run_steps(session, run_id)]
    return _page(
        request,
        "run.html",
        run=run,
        row=row,
        terminal=run.status in TERMINAL_STATUSES,
        figure=figure,
        timeline=charts.step_timeline_figure(steps) if steps else None,
        artifacts=[artifact_out(a) for a in queries.run_artifacts(session, run_id)],
        env=run.environment,
        figures=export.figures(row),
    )


class _Pairs:
    """A comparison's pairs (compare.iter_pairs) as the compare page reads them: counted
    once, then made afresh for each pass over them, so none is kept between passes."""

    def __init__(self, comparison: sweep_results.Comparison) -> None:
        self.a, self.b = comparison.a, comparison.b
        self.count = sum(1 for _ in compare.iter_pairs(self.a, self.b))

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return compare.iter_pairs(self.a, self.b)


FIGURE_KEYS = ("label", "tps_ratio", "tps_lo", "tps_hi", "time_change")
"""What the comparison's chart reads of a pair (charts.compare_figure)."""


@router.get("/compare", response_class=HTMLResponse)
@_friendly
def compare_page(
    request: Request,
    session: SessionDep,
    a: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Sweep A (the baseline).")] = None,
    b: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="Sweep B (compared with A).")
    ] = None,
) -> Response:
    """Two sweeps side by side: B/A for every cell with the same config; regressions marked.
    Both sweeps are held as their sides (compare.Sides), and the page is sent as it renders."""
    sweeps = store.list_sweeps(session, skip=0, limit=500, kind=None, name=None).data
    context: dict[str, Any] = {"sweeps": [_summary(s) for s in sweeps], "a": a, "b": b}
    context["pairs"] = None
    if a is None or b is None:
        return _page(request, "compare.html", **context)
    sa, sb = _summary_or_404(session, a), _summary_or_404(session, b)
    found = sweep_results.sweep_comparison(session, a, b)
    pairs = _Pairs(found)
    shown = [{k: p[k] for k in FIGURE_KEYS} for p in pairs]
    figure = charts.compare_figure(shown)
    del shown
    context.update(
        same_spec=found.head["same_spec"], only_a=found.head["only_a"],
        only_b=found.head["only_b"], regressions=found.head["regressions"],
        within_noise=found.head["within_noise"], too_few_count=found.head["too_few"],
        sa=sa, sb=sb, pairs=pairs, figure=figure, tolerance=compare.MEMORY_TOLERANCE,
        levels=units.levels(r.median_ci_level for r in itertools.chain(found.a, found.b)
                            if r.median_s is not None) or "nothing (no time measured)",
        confidence=compare.CONFIDENCE, too_few=compare.TOO_FEW,
    )  # fmt: skip
    return StreamingResponse(
        page_chunks(request, "compare.html", **context),
        media_type="text/html",
        background=BackgroundTask(queries.give_back_memory),  # once the page is sent
    )


def _history_figure(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The cell's median time per run in the order they ran, with its interval, titled with
    the level those intervals cover (their iteration counts set it)."""
    done = [e for e in entries if e["median_s"] is not None]
    x = [f"sweep {e['sweep_id']} · run {e['run_id']}" for e in done]
    y = [e["median_s"] * 1e3 for e in done]
    up = [((e["median_hi_s"] or e["median_s"]) - e["median_s"]) * 1e3 for e in done]
    down = [(e["median_s"] - (e["median_lo_s"] or e["median_s"])) * 1e3 for e in done]
    text = [(e["git_sha"] or "no git")[:10] + (" (dirty)" if e["git_dirty"] else "") for e in done]
    trace = {"type": "scatter", "mode": "lines+markers+text", "x": x, "y": y, "text": text,
             "textposition": "top center", "name": "median time",
             "error_y": {"type": "data", "array": up, "arrayminus": down}}  # fmt: skip
    covers = units.levels(e["median_ci_level"] for e in done) or "none"
    layout = {"title": {"text": f"Median time per run (interval at {covers}), labelled by "
                                "commit"},
              "yaxis": {"title": {"text": "ms"}, "rangemode": "tozero"},
              "xaxis": {"type": "category"}, "margin": {"t": 50}}  # fmt: skip
    return {"data": [trace], "layout": layout}


@router.get("/cells/history", response_class=HTMLResponse)
def cell_history_page(
    request: Request,
    session: SessionDep,
    run: Annotated[int | None, Query(ge=1, le=MAX_ID, description="A run of the cell.")] = None,
    cell: Annotated[str | None, Query(max_length=20_000, description="A config.")] = None,
) -> HTMLResponse:
    """One cell across every sweep that ran it: time, peak memory and code version."""
    found = history.cell_history(session, cell_config(session, run, cell))
    return _page(request, "cell_history.html", history=found, run=run,
                 figure=_history_figure(found["entries"]))  # fmt: skip


dashboard = APIRouter()
"""Everything the dashboard serves at /: its pages, its static files and its login."""
dashboard.include_router(router)
dashboard.include_router(public)
dashboard.include_router(login.router)
