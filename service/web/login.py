"""The dashboard's login: RINGLAB_API_TOKEN typed once, kept as a session cookie.

With RINGLAB_REQUIRE_TOKEN_FOR_READS a browser could not read anything: it cannot send a bearer
header, and EventSource cannot at all. POST /login checks the token and sets `ringlab_session`
(service.api.sessions: a random session id and its HMAC under the token, never the token),
HttpOnly, SameSite Strict, Max-Age RINGLAB_SESSION_TTL_S, and Secure when the request came over
https (behind a proxy: uvicorn's --forwarded-allow-ips makes X-Forwarded-Proto count). The
cookie admits reads only, until it expires or POST /logout revokes its session on the server.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Form, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from service.api.deps import SESSION_COOKIE, SettingsDep, client_address, throttled
from service.api.limits import auth_throttle
from service.api.sessions import close_session, open_session
from service.web.render import page

router = APIRouter(include_in_schema=False)


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a path on this site only (never //host or a URL)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _form(request: Request, target: str, problem: str | None, code: int) -> HTMLResponse:
    response = page(request, "login.html", next=target, problem=problem)
    response.status_code = code
    return response


@router.get("/login", response_class=HTMLResponse)
def login_page(
    request: Request,
    settings: SettingsDep,
    next: Annotated[str | None, Query(max_length=2000)] = None,
) -> Response:
    """The token form (or straight on when reads need no token)."""
    target = _safe_next(next)
    if not settings.require_token_for_reads or settings.api_token is None:
        return RedirectResponse(target, status_code=status.HTTP_303_SEE_OTHER)
    return _form(request, target, None, status.HTTP_200_OK)


@router.post("/login", response_class=HTMLResponse)
def login(
    request: Request,
    settings: SettingsDep,
    token: Annotated[str, Form(max_length=1000)],
    next: Annotated[str | None, Form(max_length=2000)] = None,
) -> Response:
    """Check the token; right: the session cookie and back to `next`; wrong: the form, 401
    (and after too many from this address, the form saying when to try again, 429)."""
    target = _safe_next(next)
    if (refusal := throttled(request)) is not None:
        wait = _form(request, target, f"{str(refusal.detail).capitalize()}.", 429)
        wait.headers.update(refusal.headers or {})
        return wait
    expected = settings.api_token
    if expected is None or not hmac.compare_digest(token.encode(), expected.encode()):
        auth_throttle(request.app.state).failed(client_address(request))
        return _form(request, target, "That is not this server's token.", 401)
    cookie = open_session(request.app.state.sessionmaker, expected, settings.session_ttl_s)
    response = RedirectResponse(target, status_code=status.HTTP_303_SEE_OTHER)
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=int(settings.session_ttl_s),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


@router.post("/logout")
def logout(request: Request, settings: SettingsDep) -> Response:
    """End the session: revoked on the server (a kept copy of the cookie no longer works), and
    the cookie goes; the next page asks for the token again."""
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie is not None and settings.api_token is not None:
        close_session(request.app.state.sessionmaker, settings.api_token, cookie)
    response = RedirectResponse("/login", status_code=status.HTTP_303_SEE_OTHER)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response
