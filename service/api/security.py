"""Security headers on every response (pages and API), as a pure ASGI middleware.

The dashboard's pages load only their own files (/static: plotly.min.js from the plotly
package, app.js, style.css), fetch and stream from the same origin, and run a few inline calls
(`ringlab.drawFromScript(...)`, `ringlab.sweepPage(id)`) that carry this request's nonce. Plotly
writes style attributes and <style> elements, hence style-src 'unsafe-inline'; the favicon is
a data: URL. No page may be framed (frame-ancestors 'none', X-Frame-Options DENY) and no
response is type-sniffed (nosniff). A response to a request that carried credentials (a bearer
token or the session cookie) is never stored by a cache (Cache-Control: no-store).

Every response names its request (X-Request-ID); an exception no handler answered becomes a JSON
500 that names it too, with the headers above, and the log line says which request failed.

SiteGuard refuses what a hostile page could make a browser send: a Host header that is not one
of this server's names (DNS rebinding: 400), and a state-changing request from another site
(403), in every mode, the open one included. A browser says where a request comes from
(Sec-Fetch-Site, else Origin); a request with neither is no browser's cross-site request (the
CLI, curl), and is let through.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

NONCE_KEY = "csp_nonce"
"""Where the request's script nonce lives in request.state (templates read it)."""
REQUEST_ID_KEY = "request_id"
"""Where the request's id lives in request.state (the 500 and 503 answers name it)."""
SESSION_COOKIE = "ringlab_session"
"""The dashboard's session cookie (service.api.deps, service.web.login): it admits reads only."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_GIVEN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def content_security_policy(nonce: str) -> str:
    """The policy for a response whose inline scripts carry `nonce`."""
    return "; ".join(
        (
            "default-src 'self'",
            f"script-src 'self' 'nonce-{nonce}'",
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data:",
            "connect-src 'self'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        )
    )


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), decoded as Latin-1, or None."""
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _request_id(scope: Scope) -> str:
    """The client's X-Request-ID when it is a short plain token, else a fresh one."""
    given = _header(scope, b"x-request-id")
    return given if given is not None and _GIVEN_ID.match(given) else secrets.token_hex(8)


def _carries_credentials(scope: Scope) -> bool:
    """A bearer token or the dashboard's session cookie came with the request."""
    if _header(scope, b"authorization") is not None:
        return True
    cookie = _header(scope, b"cookie") or ""
    return any(part.strip().startswith(SESSION_COOKIE + "=") for part in cookie.split(";"))


class HttpMiddleware:
    """An ASGI middleware of HTTP requests (`http`); other scopes (lifespan) pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one HTTP request (self.app is the rest of the stack)."""
        raise NotImplementedError


class SecurityHeaders(HttpMiddleware):
    """Adds Content-Security-Policy (with a fresh script nonce per request, also put in
    request.state.csp_nonce), X-Content-Type-Options: nosniff, X-Frame-Options: DENY and
    X-Request-ID (request.state.request_id); Cache-Control: no-store when the request carried
    credentials (static files excepted: code, the same for everyone)."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        nonce = secrets.token_urlsafe(16)
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state[NONCE_KEY], state[REQUEST_ID_KEY] = nonce, request_id
        extra = [
            (b"content-security-policy", content_security_policy(nonce).encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"),
            (b"x-request-id", request_id.encode()),
        ]
        if _carries_credentials(scope) and not scope["path"].startswith("/static/"):
            extra.append((b"cache-control", b"no-store"))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                added = [(k, v) for k, v in extra if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, with_headers)


async def send_json(send: Send, status: int, body: dict[str, object]) -> None:
    """Answer with `body` as JSON (a middleware's own answer: no route ran)."""
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


class ServerErrors(HttpMiddleware):
    """An exception no handler answered: a JSON 500 naming the request id (inside
    SecurityHeaders, so it has the security headers), and one log line naming the request
    with the traceback. Once the response has started (a stream) it can only be cut."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            request_id = scope.get("state", {}).get(REQUEST_ID_KEY, "-")
            log.exception("500 for %s %s (request %s)", scope["method"], scope["path"], request_id)
            if started:
                raise
            detail = f"internal error; the server's log names request {request_id}"
            await send_json(send, 500, {"detail": detail, "request_id": request_id})


def _host_name(host: str) -> str:
    """A Host header's name: no port, lower case, an IPv6 address without brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def cross_site_problem(method: str, host: str, site: str | None, origin: str | None) -> str | None:
    """Why a request from a browser on another site must not change anything, or None.

    Safe methods change nothing. Sec-Fetch-Site (every current browser) must be same-origin
    or none (typed by the user); without it an Origin must name this host. A request with
    neither header is no browser's cross-site request: the CLI and curl send none."""
    if method in SAFE_METHODS:
        return None
    if site is not None:
        if site in ("same-origin", "none"):
            return None
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    if origin is None:
        return None
    parsed = urlsplit(origin) if origin != "null" else None
    if parsed is not None and parsed.netloc.lower() == host.strip().lower():
        return None
    return f"cross-site request refused: Origin {origin[:200]} is not this server ({host[:200]})"


class SiteGuard(HttpMiddleware):
    """400 for a Host header not in `allowed_hosts` (None: any host); 403 for a
    state-changing request a browser sent from another site (cross_site_problem)."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None) -> None:
        super().__init__(app)
        self.allowed_hosts = allowed_hosts

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = _header(scope, b"host") or ""
        if self.allowed_hosts is not None and _host_name(host) not in self.allowed_hosts:
            detail = (
                f"Host {host[:200]!r} is not a name this server answers to; "
                "add it to RINGLAB_ALLOWED_HOSTS (comma-separated)"
            )
            await send_json(send, 400, {"detail": detail})
            return
        site, origin = _header(scope, b"sec-fetch-site"), _header(scope, b"origin")
        if problem := cross_site_problem(scope["method"], host, site, origin):
            await send_json(send, 403, {"detail": problem})
            return
        await self.app(scope, receive, send)
