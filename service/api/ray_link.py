"""This API process' link to Ray: used by /cluster and /readyz.

The embedded scheduler connects Ray at start; an API-only process connects on first use when
RINGLAB_RAY_ADDRESS is set, and otherwise reports that it has no cluster (never starts one).
"""

from __future__ import annotations

import threading

from starlette.requests import HTTPConnection

from service.core.config import Settings

_connect_lock = threading.Lock()


def problem(settings: Settings, *, may_connect: bool) -> str | None:
    """None when Ray is connected and has an alive node; else why not, in one line.

    may_connect is False when the embedded scheduler owns the connection (it connects at start,
    with backoff, and says how that goes in service.ray_status; a second ray.init racing it
    would fail).
    """
    import ray

    from service.ray_status import RAY

    if not ray.is_initialized():
        if not may_connect:
            return RAY.problem() or "not connected: the embedded scheduler has not started"
        if settings.ray_address is None:
            return (
                "not connected: this process runs no scheduler and RINGLAB_RAY_ADDRESS is unset "
                "(run `ringlab serve` with its scheduler, or set the address)"
            )
        from workers import cluster

        with _connect_lock:
            if not ray.is_initialized():
                try:
                    cluster.connect(settings.ray_address)
                except (ConnectionError, RuntimeError, ValueError) as e:
                    return f"cannot connect to {settings.ray_address}: {e}"
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
    except (ConnectionError, RuntimeError) as e:
        return f"connected but not answering: {e}"
    if not alive:
        return "connected but no node is alive"
    return None


def queue_problem(request: HTTPConnection) -> str | None:
    """Why queued runs cannot start now, as far as this process knows: its embedded scheduler
    stopped, or cannot reach Ray (service.ray_status). None otherwise: connected, still
    starting, or no embedded scheduler (a `ringlab scheduler` elsewhere reports in its log)."""
    from service.ray_status import RAY

    state = request.app.state
    thread = getattr(state, "scheduler_thread", None)
    if thread is None:
        return None
    if not thread.is_alive():
        why = getattr(state, "scheduler_error", None) or "exited"
        return f"queued: the embedded scheduler stopped: {why}"
    return RAY.queue_note()
