"""Security headers on every response (pages and API), as a pure ASGI middleware.

The dashboard's pages load only their own files (/static: plotly.min.js from the plotly
package, app.js, style.css), fetch and stream from the same origin, and run a few inline calls
(`ringlab.drawFromScript(...)`, `ringlab.sweepPage(id)`) that carry this request's nonce. Plotly
writes style attributes and <style> elements, hence style-src 'unsafe-inline'; the favicon is
a data: URL. No page may be framed (frame-ancestors 'none', X-Frame-Options DENY) and no
response is type-sniffed (nosniff).
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

NONCE_KEY = "csp_nonce"
"""Where the request's script nonce lives in request.state (templates read it)."""


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


class SecurityHeaders:
    """Adds Content-Security-Policy (with a fresh script nonce per request, also put in
    request.state.csp_nonce), X-Content-Type-Options: nosniff and X-Frame-Options: DENY."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        nonce = secrets.token_urlsafe(16)
        scope.setdefault("state", {})[NONCE_KEY] = nonce
        extra = [
            (b"content-security-policy", content_security_policy(nonce).encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"),
        ]

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                added = [(k, v) for k, v in extra if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, with_headers)
