"""Request dependencies: the database session, the settings and bearer-token auth."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

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


def _check_token(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> None:
    if settings.api_token is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), settings.api_token.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token (Authorization: Bearer <RINGLAB_API_TOKEN>)",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_write(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """Mutating endpoints: the token is required whenever one is configured."""
    _check_token(settings, credentials)


async def require_read(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """Reads: open unless settings.require_token_for_reads."""
    if settings.require_token_for_reads:
        _check_token(settings, credentials)


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

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
CURSOR_HELP = "The `next` of the previous page (same sort); overrides nothing else."
