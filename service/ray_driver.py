"""The Ray driver process: the one process of ringlab that talks to Ray (`python -m
service.ray_driver`, started and watched by service.ray_supervisor).

Ray's driver cannot outlive its cluster: a call pending when the GCS comes back as a new
cluster ends the process with a failed check (WrongClusterID), and after
`gcs_rpc_server_reconnect_timeout_s` without the GCS the driver exits ("Failed to connect to
GCS within 60 seconds ... The program will terminate"). So the API never joins Ray itself:
this process connects once, probes the cluster every PROBE_S with a deadline, reports what it
sees on a pipe (one JSON object a line) and, when asked, runs the scheduler. When Ray is lost
the supervisor kills it and starts a fresh one, which connects to whatever cluster answers at
the address then (a new cluster ID included).

Protocol: the first line on stdin is {"settings": {...}, "schedule": bool, "grace_s": float};
a later "stop" line, or the end of stdin, stops it. Messages on the fd named by DRIVER_FD_ENV:
connected (with the scheduler's owner and the local Ray's processes), failed (the reason),
cluster (workers.cluster.describe()), lost (why a probe failed).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from service.core.config import Settings
from service.db.engine import make_engine, make_sessionmaker
from service.ray_status import reason

DRIVER_FD_ENV = "RINGLAB_DRIVER_FD"
PROBE_S = 1.0
"""How often the cluster is read (the supervisor's /cluster and /readyz come from it)."""
PROBE_DEADLINE_S = 4.0
"""A probe not answered by then means the GCS is gone (Ray's own calls would wait for ever)."""

log = logging.getLogger("service.ray_driver")


class Channel:
    """The message pipe to the supervisor (writes from several threads, one line each)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "at": time.time(), **fields}, default=str)
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (BrokenPipeError, ValueError):  # the supervisor is gone: stop with it
                os._exit(1)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), whatever state Ray left it in."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the end of stdin still stops it


def _watch_stdin(stop: threading.Event) -> None:
    """A "stop" line or the end of stdin (the supervisor closed it, or died) stops the driver."""
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def _probe_once(deadline_s: float) -> dict[str, Any]:
    """workers.cluster.describe() within deadline_s (TimeoutError otherwise)."""
    from workers import cluster  # Ray: this process only (the API imports this module)

    result: list[Any] = []

    def call() -> None:
        try:
            result.append(cluster.describe())
        except Exception as exc:  # reported to the caller as the probe's failure
            result.append(exc)

    thread = threading.Thread(target=call, name="ringlab-ray-probe", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if not result:
        raise TimeoutError(f"the GCS did not answer within {deadline_s:g} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return dict(result[0])


def _probe_forever(channel: Channel, stop: threading.Event) -> None:
    """Report the cluster every PROBE_S; once a probe fails, report `lost` and stop probing
    (the supervisor ends this process and starts a fresh one)."""
    while not stop.is_set():
        try:
            info = _probe_once(PROBE_DEADLINE_S)
        except Exception as exc:  # any failure of a probe means the cluster is not answering
            channel.send("lost", reason=reason(exc))
            return
        channel.send("cluster", info=info)
        stop.wait(PROBE_S)


def _schedule(config: dict[str, Any], settings: Any, owner: str, stop: threading.Event) -> None:
    from service.scheduler import Scheduler  # torch and Ray: this process only, once connected
    from workers.gang import GangPool  # Ray: this process only

    engine = make_engine(settings.database_url)
    pool = GangPool(warm_ttl_s=settings.warm_gang_ttl_s)
    try:
        Scheduler(
            make_sessionmaker(engine),
            pool=pool,
            owner=owner,
            max_concurrent=settings.max_concurrent_runs,
            grace_s=float(config.get("grace_s", 3.0)),
        ).run_forever(stop)
    finally:
        pool.close()
        engine.dispose()


def main() -> int:
    """Connect, report, schedule when asked, until stopped; 1 when Ray cannot be joined."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C: the supervisor stops us
    channel = Channel(os.fdopen(int(os.environ[DRIVER_FD_ENV]), "w", buffering=1))
    config = json.loads(sys.stdin.readline())
    from workers import cluster, local_ray  # Ray: this process only (the API imports this module)

    settings = Settings(**config["settings"])
    stop = threading.Event()
    try:
        cluster.connect(settings.ray_address)
    except Exception as exc:  # any failure to join: reported, and the supervisor retries
        channel.send("failed", reason=reason(exc))
        return 1
    # ray.init installed a SIGTERM handler that exits at once: ours stops cleanly instead.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from service.scheduler import default_owner  # torch: after Ray's connection, not before

    owner = default_owner()
    channel.send("connected", owner=owner, local_ray=local_ray.recorded())
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    threading.Thread(target=_probe_forever, args=(channel, stop), daemon=True).start()
    try:
        if config.get("schedule"):
            _schedule(config, settings, owner, stop)
        else:
            stop.wait()
    finally:
        local_ray.stop_leftovers()
        import ray  # this process only (the API imports this module)

        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
