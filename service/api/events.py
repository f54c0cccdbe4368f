"""Server-sent events for one sweep: poll the database, emit what changed, end when it is done.

Events: `progress` (the sweep with its counts; first at connect and after every change),
`run` (one run's new state: id, status, previous status, attempts, error) and a last `end`
(the final sweep, or {"id", "deleted": true}). The database is the truth, so any number of
API replicas can serve streams while the scheduler writes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import HTTPException, Query, Request, status
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette.sse import EventSourceResponse

from service.api import store
from service.api.deps import SweepId
from service.api.schemas import SweepOut

DEFAULT_POLL_S = 1.0
PING_S = 15
STREAM_POLL_THREADS = 4
"""Worker threads all of an app's event streams share for their database polls. Streams wait
for each other, never for the thread pool that serves requests: 50 unread streams on a large
sweep used to hold its 40 threads, so /healthz and POSTs waited behind them."""


def _poll_limiter(app_state: Any) -> anyio.CapacityLimiter:
    """The app's stream-poll limiter, made on first use inside the event loop."""
    limiter = getattr(app_state, "stream_poll_limiter", None)
    if limiter is None:
        limiter = app_state.stream_poll_limiter = anyio.CapacityLimiter(STREAM_POLL_THREADS)
    return limiter


def _poll(
    factory: sessionmaker[Session], sweep_id: int
) -> tuple[SweepOut, dict[int, store.RunState]] | None:
    with factory() as session:
        sweep = store.load_sweep_out(session, sweep_id)
        if sweep is None:
            return None
        return sweep, store.run_states(session, sweep_id)


def _run_event(run_id: int, state: store.RunState, previous: str | None) -> dict[str, str]:
    data = {
        "id": run_id,
        "status": state.status,
        "previous": previous,
        "attempts": state.attempts,
        "error": state.error,
    }
    return {"event": "run", "data": json.dumps(data)}


async def _stream(app_state: Any, sweep_id: int, poll_s: float) -> AsyncIterator[dict[str, Any]]:
    """Poll (on the app's stream-poll threads) and yield what changed until the sweep is done."""
    factory: sessionmaker[Session] = app_state.sessionmaker
    previous: dict[int, store.RunState] | None = None
    while True:
        snapshot = await anyio.to_thread.run_sync(
            _poll, factory, sweep_id, limiter=_poll_limiter(app_state)
        )
        if snapshot is None:
            yield {"event": "end", "data": json.dumps({"id": sweep_id, "deleted": True})}
            return
        sweep, states = snapshot
        if previous is None:
            yield {"event": "progress", "data": sweep.model_dump_json()}
        else:
            changed = False
            for run_id, state in states.items():
                before = previous.get(run_id)
                if before != state:
                    changed = True
                    yield _run_event(run_id, state, before.status if before else None)
            if changed:
                yield {"event": "progress", "data": sweep.model_dump_json()}
        previous = states
        if sweep.done:
            yield {"event": "end", "data": sweep.model_dump_json()}
            return
        await anyio.sleep(poll_s)


def sweep_events(
    sweep_id: SweepId,
    request: Request,
    poll_s: Annotated[
        float, Query(ge=0.05, le=60, description="Seconds between database polls.")
    ] = DEFAULT_POLL_S,
) -> EventSourceResponse:
    """Stream run state changes and progress of a sweep; the stream ends when the sweep does."""
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    with factory() as session:
        if store.load_sweep_out(session, sweep_id) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} not found")
    return EventSourceResponse(_stream(request.app.state, sweep_id, poll_s), ping=PING_S)
