"""How every dashboard page is rendered: the Jinja2 templates, their filters and the context the
shared header needs. The pages (router) and the login page both render through page()."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from service import units
from service.api import errors, ray_link
from service.results.report import COMPONENT_TITLES

HERE = Path(__file__).resolve().parent
STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}

templates = Jinja2Templates(directory=HERE / "templates")


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


RATE_UNITS = (
    ("tflops_per_s", None),  # already in TFLOP/s
    ("flops_per_s", "FLOP/s"),
    ("tokens_per_s", "tok/s"),
    ("bytes_per_s", None),  # binary units
    ("_per_s", "/s"),
)
"""How a rate's name ends, and the unit its value is shown in."""


def _fmt_rate(value: float, name: str) -> str:
    """A rate by its name: TFLOP/s as stored, bytes/s in binary units, others SI-prefixed."""
    suffix, unit = next((s, u) for s, u in RATE_UNITS if name.endswith(s))
    if suffix == "tflops_per_s":
        return f"{value:.4g} TFLOP/s"
    if suffix == "bytes_per_s":
        return f"{_fmt_bytes(value)}/s"
    return _fmt_si(value, unit or "")


def _fmt_figure(value: float | int | str | bool, name: str) -> str:
    """A row's figure by its name's unit: seconds (`_s`), bytes (`_bytes`), rates
    (`_per_s`, _fmt_rate), other numbers to 4 significant digits or with separators."""
    if isinstance(value, bool | str):
        return str(value)
    if name.endswith("_per_s"):
        return _fmt_rate(value, name)
    if name.endswith("_s"):
        return _fmt_s(value)
    if name.endswith("_bytes"):
        return _fmt_bytes(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def _fmt_compiling(rank: Any) -> str:
    """A rank's compilation outside its timed iterations: '3 graphs in 41.2 s', 'none', or
    '—' when not recorded (stored before 0019)."""
    count, seconds = rank.compilations, rank.compile_s
    if count is None or seconds is None:
        return "—"
    if count == 0:
        return "none"
    return f"{count} graph{'s' if count != 1 else ''} in {_fmt_s(seconds)}"


templates.env.filters["si"] = _fmt_si
templates.env.filters["compiling"] = _fmt_compiling
templates.env.filters["figure"] = _fmt_figure
templates.env.filters["nbytes"] = _fmt_bytes
templates.env.filters["secs"] = _fmt_s
templates.env.filters["level"] = units.level
templates.env.filters["levels"] = units.levels
templates.env.globals["component_titles"] = COMPONENT_TITLES
templates.env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True)


@cache
def _static_version() -> str:
    """A cache-busting tag that changes whenever a static file does."""
    mtimes = [int((HERE / "static" / n).stat().st_mtime) for n in STATIC_FILES]
    return str(max(mtimes))


def page(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """The template `name` rendered with the header's context (static version, queue problem)."""
    context.setdefault("static_version", _static_version())
    context.setdefault("queue_problem", ray_link.queue_problem(request))  # the header says it
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def _wants_page(request: Request) -> bool:
    """A dashboard page (HTML), not the API, a page's JSON or a static file."""
    path = request.url.path
    return not path.startswith(("/api/", "/static/", "/docs/")) and not path.endswith(".json")


async def database_unavailable(request: Request, exc: Exception) -> Response:
    """The app's 503 while the database cannot answer: for a dashboard page an HTML page with
    the reason (and Retry-After), for the rest the API's JSON (errors.database_unavailable)."""
    if not _wants_page(request):
        return await errors.database_unavailable(request, exc)
    errors.log.warning("database unavailable for page %s: %s", request.url.path, exc)
    response = page(
        request,
        "unavailable.html",
        503,
        detail=errors.unavailable_detail(exc),
        retry_after_s=errors.DATABASE_RETRY_AFTER_S,
    )
    response.headers["Retry-After"] = str(errors.DATABASE_RETRY_AFTER_S)
    return response
