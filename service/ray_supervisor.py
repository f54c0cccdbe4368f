"""Keeps a Ray driver process (service.ray_driver) alive for the API and the scheduler, so that
losing Ray never ends ringlab's own process.

Why a child process: Ray's driver cannot survive its cluster. A call pending when the GCS is
killed waits with no deadline, `gcs_rpc_server_reconnect_timeout_s` later the driver exits, and
one pending when the GCS comes back as a new cluster fails a check (WrongClusterID) that ends
the process; raising the timeout only trades the exit for hung calls, and ray.shutdown() does
not cancel them. A child that holds every Ray call can be killed whatever state Ray left it in,
and a fresh one joins whatever cluster then answers, a new one included.

The supervisor (a thread of `ringlab serve` or `ringlab scheduler`) connects with backoff
(service.ray_status.connect_with_backoff: each attempt a fresh driver; its stderr is forwarded,
and an auth failure there ends the attempt at once with Ray's reason), then watches: the driver
reports the cluster every second (ray_driver.PROBE_S) and says when a probe fails. When Ray is
lost, or the driver dies or falls silent, the driver is killed (with the local Ray it started),
the runs it held go back to the queue at once with the reason, their attempt not consumed, and
it reconnects. /readyz and /cluster read what the supervisor last heard: they never wait on Ray.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from typing import IO, Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from service import leases
from service.core.config import Settings
from service.ray_driver import DRIVER_FD_ENV, PROBE_DEADLINE_S, PROBE_S
from service.ray_status import RAY, DriverFailed, Link, RayStatus, connect_with_backoff
from workers import local_ray

log = logging.getLogger(__name__)

SILENT_S = PROBE_S + PROBE_DEADLINE_S + 4.0
"""A connected driver silent this long is wedged: it is treated as Ray lost."""
STOP_WAIT_S = 6.0
"""How long a stopping driver may take (its runs get the scheduler's grace first) before it is
killed; `ringlab serve` then still exits within 10 s of a SIGTERM."""
DRIVER_GRACE_S = 3.0
"""The driver's scheduler gives its runs this long to finish at a stop; then they are requeued."""
AUTH_FAILURES = ("InvalidAuthToken", "Authentication token is missing or incorrect")
AUTH_HINT = (
    "this process' Ray auth token is missing or not the cluster's: set RAY_AUTH_MODE=token and "
    "the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
)


def clock(at: float) -> str:
    """HH:MM:SS UTC of a time.time()."""
    return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S UTC")


class _Driver:
    """One driver process and the threads that read its pipe and stderr into `events`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.owner: str | None = None
        self.local_ray: dict[int, tuple[int, int]] = {}
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.ray_driver"],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            env={**os.environ, DRIVER_FD_ENV: str(write_fd)},
            text=True,
        )
        os.close(write_fd)
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        pipe = os.fdopen(read_fd, "r")
        threading.Thread(target=self._read_pipe, args=(pipe,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True).start()

    def _read_pipe(self, pipe: IO[str]) -> None:
        with pipe:
            for line in pipe:
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    log.warning("ray driver: unreadable message %r", line[:200])
        self.events.put({"event": "exit", "at": time.time()})

    def _read_stderr(self, stream: IO[str]) -> None:
        """Forward the driver's log lines to this process' stderr; Ray's auth failure, which
        it only logs while ray.init keeps retrying for tens of seconds, ends the attempt."""
        for line in stream:
            sys.stderr.write(line)
            if any(mark in line for mark in AUTH_FAILURES):
                self.events.put({"event": "failed", "reason": _auth_reason(line)})

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def stop(self, wait_s: float) -> None:
        """Ask the driver to stop, SIGKILL it after wait_s, then the local Ray it started."""
        if self.proc.poll() is None:
            self.local_ray.update(local_ray.descendants(self.proc.pid))
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass  # it is already exiting: the wait below sees it
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                log.warning("ray driver %d did not stop within %g s; killed", self.proc.pid, wait_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the driver, then what it started that outlives it (a local Ray's raylet and
        agents, recorded when it connected and before it was asked to stop)."""
        if self.proc.poll() is None:
            self.local_ray.update(local_ray.descendants(self.proc.pid))
            self.proc.kill()
            self.proc.wait()
        local_ray.kill_processes(self.local_ray)


def _auth_reason(line: str) -> str:
    start = line.find("InvalidAuthToken")
    said = line[start:].strip() if start >= 0 else line.strip()
    return f"{said[:300]} ({AUTH_HINT})"


class Supervisor:
    """Runs (`run`, on its own thread) one Ray driver after another until stopped; `cluster`
    is what the connected driver last reported."""

    def __init__(
        self,
        settings: Settings,
        sm: sessionmaker[Session] | None,
        *,
        schedule: bool,
        status: RayStatus = RAY,
        grace_s: float = DRIVER_GRACE_S,
    ) -> None:
        """sm: the database where a lost driver's runs are requeued (None when it schedules
        nothing); schedule: whether the driver runs the scheduler or only reports the cluster."""
        if schedule and sm is None:
            raise ValueError("sm: a scheduling driver's runs need a database to requeue them")
        self.settings = settings
        self.sm = sm
        self.schedule = schedule
        self.status = status
        self.grace_s = grace_s
        self.where = settings.ray_address or "a local Ray"
        self._driver: _Driver | None = None
        self._info: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def cluster(self) -> dict[str, Any] | None:
        """workers.cluster.describe() as the connected driver last reported it; None when none
        is connected."""
        with self._lock:
            return None if self._info is None else dict(self._info)

    def run(self, stop: threading.Event) -> None:
        """Connect, watch, and after each loss of Ray reconnect, until `stop`."""
        self._stop = stop
        lost: str | None = None
        try:
            while connect_with_backoff(
                self.settings.ray_address, self._connect, stop, self.status, failed=lost
            ):
                why = self._watch(stop)
                if why is None:
                    return
                lost = self._lose(why)
        finally:
            self._stop_driver()

    def _config(self) -> dict[str, Any]:
        return {
            "settings": self.settings.model_dump(mode="json"),
            "schedule": self.schedule,
            "grace_s": self.grace_s,
        }

    def _connect(self, address: str | None) -> None:
        """Start a driver and wait until it joined Ray (DriverFailed with its reason if not)."""
        driver = _Driver(self._config())
        self._driver = driver
        while True:
            event = driver.next_event(0.2)
            if self._stop.is_set():  # a stop while Ray is slow to answer: at once
                driver.kill()
                self._driver = None
                raise DriverFailed("stopped while connecting")
            if event is None:
                continue
            kind = event["event"]
            if kind == "connected":
                driver.owner = event["owner"]
                driver.local_ray = {int(k): tuple(v) for k, v in event["local_ray"].items()}
                return
            if kind in ("failed", "exit"):
                driver.kill()
                self._driver = None
                exited = f"the Ray driver exited ({driver.proc.returncode})"
                raise DriverFailed(event.get("reason") or exited)

    def _watch(self, stop: threading.Event) -> str | None:
        """Keep the latest cluster report until Ray is lost (why) or `stop` (None)."""
        driver = self._driver
        assert driver is not None
        heard = time.monotonic()
        while not stop.is_set():
            event = driver.next_event(0.2)
            now = time.monotonic()
            if event is None:
                if now - heard > SILENT_S:
                    return f"the Ray driver did not answer for {SILENT_S:g} s"
                continue
            heard = now
            kind = event["event"]
            if kind == "cluster":
                with self._lock:
                    self._info = event["info"]
            elif kind == "lost":
                return str(event["reason"])
            elif kind == "exit":
                return f"the Ray driver exited ({driver.proc.poll()})"
            elif kind == "failed":
                return str(event["reason"])
        return None

    def _lose(self, why: str) -> str:
        """Ray was lost: kill the driver, requeue its runs with the reason; the reason the
        reconnection shows."""
        at = time.time()
        with self._lock:
            self._info = None
        self.status.set(Link("unreachable", self.where, 0, at, f"lost at {clock(at)}: {why}", at))
        log.error("lost Ray at %s (%s); its runs go back to the queue", self.where, why)
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.kill()
            gone = f"Ray at {self.where} lost at {clock(at)}; rank actors gone ({why})"
            self._requeue(driver, f"requeued: {gone}")
        return f"lost at {clock(at)}: {why}"

    def _requeue(self, driver: _Driver, error: str) -> None:
        if self.sm is None or driver.owner is None:
            return
        try:
            ids = leases.requeue_held_by(self.sm, driver.owner, error)
        except DBAPIError:  # their leases expire and recovery requeues them
            log.exception("could not requeue the runs of the lost driver %s", driver.owner)
            return
        if ids:
            log.warning("requeued %d run(s): %s: %s", len(ids), ids, error)

    def _stop_driver(self) -> None:
        driver, self._driver = self._driver, None
        if driver is None:
            return
        driver.stop(STOP_WAIT_S)
        self._requeue(driver, "requeued: the scheduler running it stopped")
