"""Request body size limit (413) as a pure ASGI middleware, so streamed bodies are capped too;
and the throttle on wrong tokens and failed logins per client address (429)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.security import HttpMiddleware

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""1 MiB: a sweep spec lists axes, not cells, so real specs are a few KiB."""


class _TooLarge(HTTPException):
    """Raised from receive(); an HTTPException so FastAPI's body parsing answers 413, not 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_bytes:,} bytes")


async def _send_json(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit(HttpMiddleware):
    """Answer 413 when Content-Length, or the bytes actually received, exceed `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"request body larger than {self.max_bytes:,} bytes"

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_json(send, 400, "Content-Length is not an integer")
                return
            if length > self.max_bytes:
                await _send_json(send, 413, self._too_large())
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if started:
                raise
            await _send_json(send, 413, self._too_large())


AUTH_FAILURES_PER_WINDOW = 10
AUTH_FAILURE_WINDOW_S = 60.0
MAX_THROTTLED_ADDRESSES = 10_000
"""Addresses whose failures are remembered at once; the stalest go first beyond it."""


class FailureThrottle:
    """Wrong tokens and failed logins per client address: after `limit` failures within
    `window_s`, that address's credentials are not even checked (429 with Retry-After) until
    its oldest failure ages out, so guessing the token costs a minute per ten tries."""

    def __init__(
        self, limit: int = AUTH_FAILURES_PER_WINDOW, window_s: float = AUTH_FAILURE_WINDOW_S
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.failures: dict[str, deque[float]] = {}
        self.lock = threading.Lock()

    def retry_after_s(self, address: str) -> int | None:
        """Whole seconds until `address` may try again, or None when it may now."""
        with self.lock:
            times = self.failures.get(address)
            if times is None:
                return None
            now = time.monotonic()
            while times and times[0] <= now - self.window_s:
                times.popleft()
            if not times:
                del self.failures[address]
                return None
            if len(times) < self.limit:
                return None
            return max(1, math.ceil(times[0] + self.window_s - now))

    def failed(self, address: str) -> None:
        """Count one failure of `address` (the oldest remembered address goes past the cap)."""
        with self.lock:
            times = self.failures.pop(address, None) or deque(maxlen=self.limit)
            times.append(time.monotonic())
            self.failures[address] = times  # last in the dict: the most recent
            if len(self.failures) > MAX_THROTTLED_ADDRESSES:
                del self.failures[next(iter(self.failures))]


_THROTTLE_LOCK = threading.Lock()


def auth_throttle(app_state: Any) -> FailureThrottle:
    """The app's FailureThrottle (made on first use)."""
    with _THROTTLE_LOCK:
        throttle = getattr(app_state, "auth_throttle", None)
        if throttle is None:
            throttle = app_state.auth_throttle = FailureThrottle()
        return throttle
