"""This process' link to Ray as its scheduler sees it: connecting, connected or unreachable.

The scheduler connects with backoff (`connect_with_backoff`) and records each attempt here;
/readyz, /cluster, queued runs and sweeps, and the dashboard's header (service.api.ray_link)
read it, so a scheduler that cannot reach Ray says why, and since when, instead of
"connecting" for ever: once an attempt failed, the link reads unreachable until one succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


@dataclass(frozen=True)
class Link:
    """One reading of the link: state is starting (the embedded scheduler migrates the
    database before its first attempt), connecting, connected or unreachable."""

    state: str
    address: str
    attempt: int
    since: float  # time.time() the state began
    error: str | None = None  # unreachable: why; connecting: why the attempt before failed
    retry_at: float | None = None  # unreachable: when the next attempt starts


class RayStatus:
    """The latest Link, shared between the scheduler thread and the API's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._link: Link | None = None

    def set(self, link: Link | None) -> None:
        with self._lock:
            self._link = link

    def get(self) -> Link | None:
        with self._lock:
            return self._link

    def problem(self) -> str | None:
        """None when connected (or never tried); else why not, in one line."""
        link = self.get()
        if link is None or link.state == "connected":
            return None
        now = time.time()
        if link.state == "starting":
            return (
                f"starting: the scheduler migrates the database, then connects to "
                f"{link.address} ({now - link.since:.0f} s so far)"
            )
        if link.state == "connecting" and link.error is None:
            return (
                f"connecting to {link.address}: attempt {link.attempt}, "
                f"{now - link.since:.0f} s so far"
            )
        if link.state == "connecting":  # a retry: still unreachable until it succeeds
            return (
                f"unreachable: cannot connect to {link.address} ({link.error}); attempt "
                f"{link.attempt} under way, {now - link.since:.0f} s so far"
            )
        retry = max(0.0, (link.retry_at or now) - now)
        return (
            f"unreachable: cannot connect to {link.address} ({link.error}); attempt "
            f"{link.attempt + 1} in {retry:.0f} s"
        )

    def queue_note(self) -> str | None:
        """Why queued runs wait, once an attempt to reach Ray has failed and until one
        succeeds: 'queued: the scheduler cannot reach Ray at X: <reason>'; else None."""
        link = self.get()
        if link is None or link.state == "connected" or link.error is None:
            return None
        return f"queued: the scheduler cannot reach Ray at {link.address}: {link.error}"


RAY = RayStatus()
"""This process' link (one Ray connection per process)."""


class DriverFailed(ConnectionError):
    """The Ray driver process could not join Ray; its message is the reason as it reported it."""


def reason(exc: BaseException) -> str:
    """`Type: first line of the message` (500 characters at most); a DriverFailed's own text."""
    if isinstance(exc, DriverFailed):
        return str(exc)[:500]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


def connect_with_backoff(
    address: str | None,
    connect: Callable[[str | None], None],
    stop: threading.Event,
    status: RayStatus = RAY,
    failed: str | None = None,
) -> bool:
    """Call connect(address) until it succeeds (True) or `stop` is set (False), waiting 1, 2,
    4 ... up to 30 s between attempts; each failure is logged as one line with the reason and
    recorded in `status`. `failed`: why Ray was lost, when this reconnects (shown until an
    attempt fails with its own reason)."""
    where = address or "a local Ray"
    delay = FIRST_RETRY_S
    attempt = 0
    while not stop.is_set():
        attempt += 1
        status.set(Link("connecting", where, attempt, time.time(), failed))
        try:
            connect(address)
        except Exception as exc:  # any failure to connect: logged, reported, retried
            import ray  # ray: ~1 s, only in the process that talks to Ray

            if ray.is_initialized():  # a half-made connection must not look connected
                ray.shutdown()
            now = time.time()
            why = failed = reason(exc)
            status.set(Link("unreachable", where, attempt, now, why, now + delay))
            log.error(
                "cannot connect to Ray at %s (%s); attempt %d in %g s",
                where,
                why,
                attempt + 1,
                delay,
            )
            if stop.wait(delay):
                return False
            delay = min(2 * delay, MAX_RETRY_S)
            continue
        status.set(Link("connected", where, attempt, time.time()))
        log.info("connected to Ray at %s (attempt %d)", where, attempt)
        return True
    return False
