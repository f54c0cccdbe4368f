"""This API process' link to Ray, as its Ray driver's supervisor (service.ray_supervisor)
last heard it: used by /cluster, /readyz, queued runs and sweeps, and the dashboard's header.

Nothing here calls Ray: the driver process does, and reports. A process with no scheduler and
no RINGLAB_RAY_ADDRESS has no driver and says so (it never starts a cluster).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import HTTPConnection

NO_DRIVER = (
    "not connected: this process runs no scheduler and RINGLAB_RAY_ADDRESS is unset "
    "(run `ringlab serve` with its scheduler, or set the address)"
)


def problem(state: Any) -> str | None:
    """None when Ray is connected and has an alive node; else why not, in one line.
    `state`: the app's state (its `ray_supervisor`)."""
    from service.ray_status import RAY  # Ray's status module loads ray: kept off the API's start-up

    supervisor = getattr(state, "ray_supervisor", None)
    if supervisor is None:
        return NO_DRIVER
    if (link_problem := RAY.problem()) is not None:
        return link_problem
    info = supervisor.cluster()
    if info is None:
        return "connected: waiting for the Ray driver's first report of the cluster"
    if not info["nodes"]:
        return "connected but no node is alive"
    return None


def cluster_info(state: Any) -> dict[str, Any] | None:
    """workers.cluster.describe() as the Ray driver last reported it (None: not connected)."""
    supervisor = getattr(state, "ray_supervisor", None)
    return None if supervisor is None else supervisor.cluster()


def queue_problem(request: HTTPConnection) -> str | None:
    """Why queued runs cannot start now, as far as this process knows: its embedded scheduler
    stopped, or cannot reach Ray (service.ray_status). None otherwise: connected, still
    starting, or no embedded scheduler (a `ringlab scheduler` elsewhere reports in its log)."""
    from service.ray_status import RAY  # Ray's status module loads ray: kept off the API's start-up

    state = request.app.state
    thread = getattr(state, "scheduler_thread", None)
    if thread is None:
        return None
    if not thread.is_alive():
        why = getattr(state, "scheduler_error", None) or "exited"
        return f"queued: the embedded scheduler stopped: {why}"
    return RAY.queue_note()
