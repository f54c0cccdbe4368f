"""The dashboard: server-rendered pages (Jinja2) with Plotly charts, served by the service itself.

plotly.js comes from the plotly Python package's own data, so nothing is fetched from outside.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Annotated, Any

import plotly
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.templating import Jinja2Templates

from service.api.deps import MAX_ID, RunId, SessionDep, SweepId, require_read
from service.db.models import TERMINAL_STATUSES
from service.web import charts, data
from service.web.peaks import dense_peak_flops
from service.web.rows import memory_floor_bytes, run_row

HERE = Path(__file__).resolve().parent
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}

templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(include_in_schema=False, dependencies=[Depends(require_read)])


def _fmt_si(value: float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M' + unit; None -> '—'."""
    if value is None:
        return "—"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def _fmt_bytes(value: float | None) -> str:
    """Bytes in binary units: 1536 -> '1.50 KiB'."""
    if value is None:
        return "—"
    for factor, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{int(value)} B"


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


templates.env.filters["si"] = _fmt_si
templates.env.filters["nbytes"] = _fmt_bytes
templates.env.filters["secs"] = _fmt_s
templates.env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True)


@cache
def _static_version() -> str:
    """A cache-busting tag that changes whenever a static file does."""
    mtimes = [int((HERE / "static" / n).stat().st_mtime) for n in STATIC_FILES]
    return str(max(mtimes))


def _page(request: Request, name: str, **context: Any) -> HTMLResponse:
    context.setdefault("static_version", _static_version())
    return templates.TemplateResponse(request, name, context)


@router.get("/static/plotly.min.js")
def plotly_js() -> FileResponse:
    """plotly.js from the installed plotly package (no CDN: clusters are often offline)."""
    return FileResponse(PLOTLY_JS, media_type="text/javascript")


@router.get("/static/{name}")
def static_file(name: str) -> FileResponse:
    """The dashboard's own script and style sheet (a fixed list: no path traversal)."""
    if name not in STATIC_FILES:
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(HERE / "static" / name, media_type=STATIC_FILES[name])


@router.get("/", response_class=HTMLResponse)
def sweeps_page(
    request: Request,
    session: SessionDep,
    page: Annotated[int, Query(ge=1, le=MAX_ID)] = 1,
    per_page: Annotated[int, Query(ge=1, le=500)] = 50,
) -> HTMLResponse:
    """Every sweep, newest first: kind, created, progress and run counts by state."""
    sweeps, total = data.list_sweeps(session, (page - 1) * per_page, per_page)
    return _page(
        request,
        "sweeps.html",
        sweeps=sweeps,
        total=total,
        page=page,
        per_page=per_page,
        pages=max(1, -(-total // per_page)),
    )


def _sweep_payload(session: SessionDep, sweep_id: int) -> dict[str, Any]:
    summary = data.sweep_summary(session, sweep_id)
    if summary is None:
        raise HTTPException(404, f"no sweep {sweep_id}")
    rows = data.sweep_rows(session, sweep_id)
    for r in rows:
        r["floor_bytes"] = memory_floor_bytes(r)
        peak = dense_peak_flops(r["device"], r["dtype"])
        fps = r["flops_per_s_per_rank"]
        r["peak_fraction"] = fps / peak if peak and fps is not None else None
        r.pop("config_key")
    return {"sweep": summary.as_dict(), "rows": rows, "figures": charts.sweep_figures(rows)}


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, session: SessionDep, sweep_id: SweepId) -> HTMLResponse:
    """Results table and charts of one sweep; live while it runs."""
    payload = _sweep_payload(session, sweep_id)
    return _page(request, "sweep.html", payload=payload, sweep=payload["sweep"])


@router.get("/sweeps/{sweep_id}/dashboard.json")
def sweep_data(session: SessionDep, sweep_id: SweepId) -> JSONResponse:
    """The sweep page's data (summary, rows, figures), reloaded by the page on live events."""
    return JSONResponse(_sweep_payload(session, sweep_id))


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, session: SessionDep, run_id: RunId) -> HTMLResponse:
    """One run: config, per-rank timings and memory, probes, environment, error."""
    run = data.get_run(session, run_id)
    if run is None:
        raise HTTPException(404, f"no run {run_id}")
    row = run_row(run)
    ranks = [
        {
            "rank": r.rank,
            "median_s": r.median_s,
            "p10_s": r.p10_s,
            "p90_s": r.p90_s,
            "tokens_per_s": r.tokens_per_s,
            "flops_per_s": r.flops_per_s,
            "peak_memory_bytes": r.peak_memory_bytes,
            "memory_budget_bytes": r.memory_budget_bytes,
            "backend": r.backend,
            "max_abs_error": r.max_abs_error,
            "times_s": r.times_s,
        }
        for r in run.rank_results
    ]
    figure = charts.rank_times_figure(ranks)
    return _page(
        request,
        "run.html",
        run=run,
        row=row,
        ranks=ranks,
        floor=memory_floor_bytes(row),
        terminal=run.status in TERMINAL_STATUSES,
        figure=figure,
        env=run.environment,
    )


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request,
    session: SessionDep,
    a: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Sweep A (the baseline).")] = None,
    b: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="Sweep B (compared with A).")
    ] = None,
) -> HTMLResponse:
    """Two sweeps side by side: B/A for every cell with the same config; regressions marked."""
    sweeps, _ = data.list_sweeps(session, 0, 500)
    context: dict[str, Any] = {"sweeps": sweeps, "a": a, "b": b, "pairs": None}
    if a is not None and b is not None:
        sa, sb = data.sweep_summary(session, a), data.sweep_summary(session, b)
        if sa is None or sb is None:
            raise HTTPException(404, f"no sweep {a if sa is None else b}")
        a_rows, b_rows = data.sweep_rows(session, a), data.sweep_rows(session, b)
        pairs = data.compare_rows(a_rows, b_rows)
        only_a, only_b = data.unmatched(a_rows, b_rows)
        context.update(
            only_a=only_a,
            only_b=only_b,
            sa=sa,
            sb=sb,
            pairs=pairs,
            figure=charts.compare_figure(pairs),
            tolerance=data.REGRESSION_TOLERANCE,
        )
    return _page(request, "compare.html", **context)
