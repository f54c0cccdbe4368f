"""Error responses that cost no more than the request: 422 lists capped and made safe to send.

A request with 50,000 unknown grid axes once got a 20.8 MB answer (one error each, each listing
the valid axes), and an error echoing a lone surrogate could not be encoded (a 500)."""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.spec import SPEC_FIELDS, SweepSpec

log = logging.getLogger(__name__)

MAX_ERRORS = 20
"""Errors a 422 lists; the rest are counted in one more entry."""
MAX_MESSAGE_CHARS = 1_000
"""Characters of one error's message (the longest real one, unknown axis, is ~500)."""
MAX_INPUT_CHARS = 200
"""An error echoes its input only when it is a scalar this short (never a whole object)."""


def safe_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` as UTF-8 can carry it: lone surrogates escaped, cut to `limit` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def _safe(value: Any) -> Any:
    """A loc element or ctx value with every string made safe (safe_text)."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, int | float | bool) or value is None:
        return value
    return safe_text(str(value))


def _echo(value: Any) -> Any:
    """The input an error may echo: a short scalar, else nothing (None)."""
    if isinstance(value, str):
        return safe_text(value) if len(value) <= MAX_INPUT_CHARS else None
    if isinstance(value, bool) or (isinstance(value, int) and abs(value) < 1 << 53):
        return value
    return None  # objects, lists, floats (NaN and infinities are no JSON), huge integers


def safe_error(err: dict[str, Any]) -> dict[str, Any]:
    """One pydantic-style error with loc, msg and type (input when short, ctx) safe to send."""
    out: dict[str, Any] = {
        "loc": [_safe(p) for p in err.get("loc", ())],
        "msg": safe_text(str(err.get("msg", ""))),
        "type": safe_text(str(err.get("type", "value_error")), 100),
    }
    if "input" in err and (echo := _echo(err["input"])) is not None:
        out["input"] = echo
    if isinstance(err.get("ctx"), dict):
        out["ctx"] = {safe_text(str(k), 100): _safe(v) for k, v in err["ctx"].items()}
    return out


_VALID = re.compile(r"valid: (.*?)(?: \(cell .*\))?$")
"""The names an unknown-name message lists, without the cell it names after them."""


def _names_where(loc: Sequence[Any]) -> list[str]:
    """The field names valid where an unknown field `loc` sits in a sweep spec (the request
    body, or one document of a list): the spec's own at its top, a run config's in `base`."""
    parts = list(loc)
    parts = parts[1:] if parts[:1] == ["body"] else parts
    if parts[:1] == ["documents"] and len(parts) > 1 and isinstance(parts[1], int):
        parts = parts[2:]  # one document of a multi-document file: a spec of its own
    path = [p for p in parts if isinstance(p, str)][:-1]
    if not path:
        return sorted(SweepSpec.model_fields)
    return sorted(SPEC_FIELDS) if path == ["base"] else []


def did_you_mean(err: dict[str, Any]) -> dict[str, Any]:
    """An unknown-name error with the nearest valid name added ("; did you mean 'seq_len'?"),
    from the names its message lists ("valid: ...") or the fields valid where it sits."""
    msg, loc = str(err.get("msg", "")), err.get("loc") or ()
    name = loc[-1] if loc else None
    unknown = err.get("type") == "extra_forbidden" or msg.startswith("unknown ")
    if not isinstance(name, str) or not unknown or "did you mean" in msg:
        return err
    listed = _VALID.search(msg)
    names = (
        [n.strip().removeprefix("or ") for n in listed.group(1).split(", ")]
        if listed
        else _names_where(loc)
    )
    close = difflib.get_close_matches(name, [n for n in names if n != name], n=1)
    if not close:
        return err
    if listed:  # the hint before the long list of valid names, where it is read
        head = msg[: listed.start()].rstrip("; ")
        return {**err, "msg": f"{head}; did you mean {close[0]!r}? {msg[listed.start() :]}"}
    return {**err, "msg": f"{msg.rstrip('.')}; did you mean {close[0]!r}?"}


def capped_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """The first MAX_ERRORS errors made safe (an unknown name with its did-you-mean), then
    one entry counting the rest."""
    shown = [safe_error(did_you_mean(dict(e))) for e in list(errors)[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        rest = len(errors) - MAX_ERRORS
        shown.append(
            {
                "loc": ["body"],
                "msg": f"{rest:,} more errors not shown (the first {MAX_ERRORS} are listed)",
                "type": "too_many_errors",
            }
        )
    return shown


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 with the capped, safe error list (replaces FastAPI's, which echoes every input)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse({"detail": jsonable_encoder(capped_errors(errors))}, status_code=422)


def _unparsable_reason(exc: StarletteHTTPException) -> str | None:
    """Why FastAPI could not parse a JSON body (its 400 hides the cause), or None."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, RecursionError):
        return "the JSON body nests too deeply to parse (a spec nests at most 32 levels)"
    if isinstance(cause, ValueError):  # e.g. an integer literal of thousands of digits
        return f"the JSON body cannot be read: {safe_text(str(cause), 200)}"
    return None


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's HTTPException answer, except that a JSON body too deep or too large in a
    number to parse is a 422 saying so (FastAPI answers a bare 400 'error parsing the body')."""
    assert isinstance(exc, StarletteHTTPException)
    if (reason := _unparsable_reason(exc)) is not None:
        error = {"loc": ["body"], "msg": reason, "type": "json_invalid"}
        return JSONResponse({"detail": [error]}, status_code=422)
    return await http_exception_handler(request, exc)


DATABASE_RETRY_AFTER_S = 5
"""Retry-After of a 503 while the database cannot be reached."""
DATABASE_ERRORS = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)
"""What SQLAlchemy raises when the database is down, unreachable, locked or out of
connections (psycopg's connection failures, SQLite's 'database is locked', a pool timeout)."""


def database_reason(exc: BaseException) -> str:
    """The driver's first line (no URL, no password: psycopg names host and port only)."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    return safe_text(f"{type(orig).__name__}: {first}", 300)


def unavailable_detail(exc: BaseException) -> str:
    """What a 503 says while the database cannot answer."""
    return f"database unavailable ({database_reason(exc)}); retry later"


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 with Retry-After and the reason as JSON, instead of a plain-text 500, when the
    database cannot answer: the request did nothing and may be repeated. (The dashboard's
    pages answer an HTML page instead: service.web.render.database_unavailable.)"""
    log.warning("database unavailable for %s %s: %s", request.method, request.url.path, exc)
    return JSONResponse(
        {"detail": unavailable_detail(exc)},
        status_code=503,
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )
