"""Request dependencies: the database session, the settings and bearer-token auth."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated
from urllib.parse import urlencode

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.api.limits import auth_throttle
from service.api.security import SESSION_COOKIE
from service.api.sessions import session_valid
from service.core.config import Settings

bearer = HTTPBearer(auto_error=False, description="RINGLAB_API_TOKEN, when the server sets one.")


async def get_settings(request: Request) -> Settings:
    """The settings the app was created with (async: no thread-pool hop for a lookup)."""
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """One session per request, closed afterwards; routes commit what they write."""
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    with factory() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
"""The request's bearer credentials (None: no Authorization header), for the auth checks."""

# The dashboard's session cookie (SESSION_COOKIE: service.web.login, service.api.sessions): a
# browser cannot send a bearer header, with EventSource least of all. It admits reads only;
# writes always need the bearer token.


def _bearer_ok(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> bool:
    if settings.api_token is None:
        return True
    given = credentials.credentials if credentials is not None else ""
    return hmac.compare_digest(given.encode(), settings.api_token.encode())


def client_address(request: Request) -> str:
    """The client's address (behind a proxy: what --forwarded-allow-ips lets uvicorn trust)."""
    return request.client.host if request.client is not None else "unknown"


def throttled(request: Request) -> HTTPException | None:
    """429 with Retry-After while the client's address has failed too often (limits.
    FailureThrottle), else None."""
    address = client_address(request)
    wait = auth_throttle(request.app.state).retry_after_s(address)
    if wait is None:
        return None
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"too many wrong tokens or logins from {address}; try again in {wait} s",
        headers={"Retry-After": str(wait)},
    )


async def _allowed(
    request: Request,
    settings: Settings,
    credentials: HTTPAuthorizationCredentials | None,
    cookie_too: bool,
) -> bool:
    """The bearer token, or (`cookie_too`) a cookie of a live session, looked up in the
    database off the event loop only when there is no right bearer token. Presented
    credentials that are wrong count against the address; while it is throttled they are
    not checked at all (429)."""
    if settings.api_token is None:
        return True
    cookie = request.cookies.get(SESSION_COOKIE) if cookie_too else None
    if credentials is None and cookie is None:
        return False  # nothing tried: no guess to count
    if (refusal := throttled(request)) is not None:
        raise refusal
    if _bearer_ok(settings, credentials):
        return True
    if cookie is not None and await run_in_threadpool(
        session_valid, request.app.state.sessionmaker, settings.api_token, cookie
    ):
        return True
    auth_throttle(request.app.state).failed(client_address(request))
    return False


def _unauthorized() -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        "missing or wrong bearer token (Authorization: Bearer <RINGLAB_API_TOKEN>)",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def require_write(
    request: Request,
    settings: SettingsDep,
    credentials: CredentialsDep,
) -> None:
    """Mutating endpoints: the token is required whenever one is configured."""
    if not await _allowed(request, settings, credentials, cookie_too=False):
        raise _unauthorized()


async def require_read(
    request: Request,
    settings: SettingsDep,
    credentials: CredentialsDep,
) -> None:
    """Reads: open unless settings.require_token_for_reads; then the bearer token or the
    dashboard's session cookie."""
    if settings.require_token_for_reads and not await _allowed(
        request, settings, credentials, cookie_too=True
    ):
        raise _unauthorized()


async def require_read_page(
    request: Request,
    settings: SettingsDep,
    credentials: CredentialsDep,
) -> None:
    """A dashboard page: as require_read, but a browser without a session is sent to the
    login page (303), which brings it back here."""
    if not settings.require_token_for_reads:
        return
    if not await _allowed(request, settings, credentials, cookie_too=True):
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise HTTPException(
            status.HTTP_303_SEE_OTHER,
            "log in first",
            headers={"Location": f"/login?{urlencode({'next': here})}"},
        )


SessionDep = Annotated[Session, Depends(get_session)]

MAX_ID = 2**31 - 1
"""Ids are 32-bit integer columns; larger path values are 422, not a database error."""
MAX_BIGINT = 2**63 - 1

SweepId = Annotated[int, Path(ge=1, le=MAX_ID, description="A sweep id.")]
RunId = Annotated[int, Path(ge=1, le=MAX_ID, description="A run id.")]

NO_NUL = r"^[^\x00]*$"
"""Pattern for free-text query values: Postgres cannot compare text holding NUL."""

MAX_SKIP = 10_000
"""`skip` is for small offsets; a deeper page follows the `next` cursor, which costs the same at
any depth (OFFSET reads and discards every row before the page)."""
SKIP_HELP = f"Rows to skip (at most {MAX_SKIP:,}); deeper pages follow `next` as `cursor`."
WITH_COUNT_HELP = (
    "false: leave `count` out (null), so a client paging on with the count it already has "
    "pays for no count."
)
CURSOR_HELP = "The `next` of the previous page (same sort); overrides nothing else."
