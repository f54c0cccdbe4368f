"""How every dashboard page is rendered: the Jinja2 templates, their filters and the context the
shared header needs. The pages (router) and the login page both render through page()."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from service import units
from service.api import errors, ray_link
from service.results.report_training import COMPONENT_TITLES

HERE = Path(__file__).resolve().parent
STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}

templates = Jinja2Templates(directory=HERE / "templates")


def _fmt_compiling(rank: Any) -> str:
    """A rank's compilation outside its timed iterations: '3 graphs in 41.2 s', 'none', or
    '—' when not recorded (stored before 0019)."""
    count, seconds = rank.compilations, rank.compile_s
    if count is None or seconds is None:
        return units.DASH
    if count == 0:
        return "none"
    return f"{count} graph{'s' if count != 1 else ''} in {units.secs(seconds)}"


def _fmt_bytes(value: float | None) -> str:
    """Bytes in binary units, as report.md writes them, '—' for none: 1536 -> '1.50 KiB'."""
    return units.nbytes(value, empty=units.DASH)


# Every number a page shows becomes text here, through service.units: a template computes
# nothing (tests/test_code_shape.py), it only picks a filter.
templates.env.filters["si"] = units.si
templates.env.filters["compiling"] = _fmt_compiling
templates.env.filters["figure"] = units.figure
templates.env.filters["nbytes"] = _fmt_bytes
templates.env.filters["secs"] = units.secs
templates.env.filters["percent"] = units.percent
templates.env.filters["bound"] = units.bound
templates.env.filters["micros"] = units.micros
templates.env.filters["kilo"] = units.kilo
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


PAGE_CHUNK_CHARS = 1 << 16
"""Characters of a streamed page sent at once: the template yields every fragment apart
(dozens a table row), and each chunk a StreamingResponse sends is a hop to the thread pool."""


def page_chunks(request: Request, name: str, **context: Any) -> Iterator[str]:
    """The template `name` rendered as page() renders it, PAGE_CHUNK_CHARS at a time (a
    StreamingResponse's body): a page of 100,000 rows is never one string in memory."""
    context.setdefault("static_version", _static_version())
    context.setdefault("queue_problem", ray_link.queue_problem(request))
    pieces: list[str] = []
    size = 0
    for piece in templates.get_template(name).generate({**context, "request": request}):
        pieces.append(piece)
        size += len(piece)
        if size >= PAGE_CHUNK_CHARS:
            yield "".join(pieces)
            pieces, size = [], 0
    if pieces:
        yield "".join(pieces)


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
