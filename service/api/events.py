"""Server-sent events for one sweep: poll the database, emit what changed, end when it is done.

Events: `progress` (the sweep with its counts; first at connect and after every change),
`run` (one run's new state: id, status, previous status, attempts, error, and for a running
search the probes stored so far with the newest as `last_probe`), `error` while the database
cannot answer (its reason as `detail`, with `retry:` in ms: the stream stays open and polls
again after DATABASE_RETRY_AFTER_S, so a follower rides out an outage), and a last `end`
(the final sweep, or {"id", "deleted": true}). The database is the truth, so any number of
API replicas can serve streams while the scheduler writes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import HTTPException, Query, Request, status
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from service.api import store
from service.api.deps import SweepId
from service.api.errors import DATABASE_ERRORS, DATABASE_RETRY_AFTER_S, database_reason
from service.api.schemas import SweepOut
from service.db.models import Sweep

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 1.0
PING_S = 15
STREAM_POLL_THREADS = 4
"""Worker threads all of an app's event streams share for their database polls. Streams wait
for each other, never for the thread pool that serves requests: 50 unread streams on a large
sweep used to hold its 40 threads, so /healthz and POSTs waited behind them."""
MAX_STREAMS = 256
"""Open event streams per process; one more is answered 429 with Retry-After."""
MAX_STREAMS_PER_CLIENT = 64
"""Open event streams per client address: one client cannot take every slot (a lab behind one
NAT address with a few dozen dashboards open still fits)."""
RETRY_AFTER_S = 5

EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event: `event` names it, `data` holds its JSON.",
    "properties": {
        "event": {"enum": ["progress", "run", "error", "end"]},
        "data": {"type": "string", "contentMediaType": "application/json"},
        "retry": {"type": "integer", "minimum": 0},
    },
    "required": ["event", "data"],
}
"""Each event of the stream, as its OpenAPI response documents it (one event per item)."""

Snapshot = tuple[SweepOut, dict[int, store.RunState]] | None
"""A sweep with its run counts and every run's state; None once the sweep is deleted."""


def _poll_limiter(app_state: Any) -> anyio.CapacityLimiter:
    """The app's stream-poll limiter, made on first use inside the event loop."""
    limiter = getattr(app_state, "stream_poll_limiter", None)
    if limiter is None:
        limiter = app_state.stream_poll_limiter = anyio.CapacityLimiter(STREAM_POLL_THREADS)
    return limiter


def _poll(factory: sessionmaker[Session], sweep_id: int) -> Snapshot:
    with factory() as session:
        sweep = store.load_sweep_out(session, sweep_id)
        if sweep is None:
            return None
        return sweep, store.run_states(session, sweep_id)


class SweepFeed:
    """One database poller per sweep, shared by every stream of that sweep.

    A stream asks for a snapshot newer than the one it has. If the newest is older than the
    stream's poll interval, the first stream to ask polls (under the lock) and the others take
    that snapshot: 50 streams on one sweep cost one query per interval, not 50.
    """

    def __init__(self, app_state: Any, sweep_id: int) -> None:
        self.app_state = app_state
        self.sweep_id = sweep_id
        self.lock = anyio.Lock()
        self.version = 0
        self.snapshot: Snapshot = None
        self.taken_at = -float("inf")
        self.streams = 0
        self.polls = 0

    async def newer_than(self, seen: int, poll_s: float) -> tuple[int, Snapshot]:
        """(version, snapshot) with version > seen, polling at most once per poll_s."""
        while self.version <= seen:
            wait = self.taken_at + poll_s - time.monotonic()
            if wait > 0:
                await anyio.sleep(wait)
                continue
            async with self.lock:
                if self.version > seen:  # another stream polled while this one waited
                    break
                factory: sessionmaker[Session] = self.app_state.sessionmaker
                self.snapshot = await anyio.to_thread.run_sync(
                    _poll, factory, self.sweep_id, limiter=_poll_limiter(self.app_state)
                )
                self.polls += 1
                self.version += 1
                self.taken_at = time.monotonic()
        return self.version, self.snapshot


class StreamSlots:
    """How many event streams are open, in all and per client; refuses one over a cap."""

    def __init__(self) -> None:
        self.total = 0
        self.per_client: dict[str, int] = {}
        self.feeds: dict[int, SweepFeed] = {}

    def open(self, app_state: Any, client: str, sweep_id: int) -> StreamSlot:
        """Take a slot with the sweep's feed, or raise 429 naming the cap that was reached."""
        if self.total >= MAX_STREAMS:
            raise _too_many(f"{MAX_STREAMS} event streams are open on this server")
        if self.per_client.get(client, 0) >= MAX_STREAMS_PER_CLIENT:
            raise _too_many(f"{MAX_STREAMS_PER_CLIENT} event streams are open from {client}")
        self.total += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1
        feed = self.feeds.get(sweep_id)
        if feed is None:
            feed = self.feeds[sweep_id] = SweepFeed(app_state, sweep_id)
        feed.streams += 1
        return StreamSlot(self, client, feed)

    def close(self, client: str, feed: SweepFeed) -> None:
        """Give a slot back (StreamSlot.release); the feed goes with its last stream."""
        self.total -= 1
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]
        feed.streams -= 1
        if feed.streams == 0 and self.feeds.get(feed.sweep_id) is feed:
            del self.feeds[feed.sweep_id]


@dataclass
class StreamSlot:
    """One open stream's slot. Released once, whichever comes first: the stream's generator
    ending, or the response's background task (which also runs when the generator never
    started, e.g. a client gone before the first event)."""

    slots: StreamSlots
    client: str
    feed: SweepFeed
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots.close(self.client, self.feed)


def _too_many(reason: str) -> HTTPException:
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"{reason}; close one or retry in {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def stream_slots(app_state: Any) -> StreamSlots:
    """The app's stream bookkeeping (made on first use)."""
    slots = getattr(app_state, "stream_slots", None)
    if slots is None:
        slots = app_state.stream_slots = StreamSlots()
    return slots


def _run_event(run_id: int, state: store.RunState, previous: str | None) -> dict[str, str]:
    data: dict[str, Any] = {
        "id": run_id,
        "status": state.status,
        "previous": previous,
        "attempts": state.attempts,
        "error": state.error,
    }
    if state.status == "running":  # a finished run's probes are in its results
        data["probes"] = state.probes
        if state.last_probe is not None:
            data["last_probe"] = {"seq_len": state.last_probe[0], "outcome": state.last_probe[1]}
    return {"event": "run", "data": json.dumps(data)}


def _outage_event(exc: BaseException) -> dict[str, Any]:
    """The `error` event of a poll the database could not answer: its reason, and when to
    expect the next try (also as the SSE retry field, for a client that reconnects)."""
    log.warning("event stream: database unavailable (%s); polling again", database_reason(exc))
    data = {
        "detail": f"database unavailable ({database_reason(exc)}); retrying",
        "retry_after_s": DATABASE_RETRY_AFTER_S,
    }
    return {"event": "error", "data": json.dumps(data), "retry": DATABASE_RETRY_AFTER_S * 1000}


async def _stream(slot: StreamSlot, poll_s: float) -> AsyncIterator[dict[str, Any]]:
    """Yield what changed between the feed's snapshots until the sweep is done or deleted (an
    `error` event for each poll the database could not answer, the stream kept open); the
    stream's slot is given back however it ends (a client that goes away included)."""
    feed = slot.feed
    try:
        seen = 0
        previous: dict[int, store.RunState] | None = None
        while True:
            try:
                seen, snapshot = await feed.newer_than(seen, poll_s)
            except DATABASE_ERRORS as e:
                yield _outage_event(e)
                await anyio.sleep(DATABASE_RETRY_AFTER_S)
                continue
            if snapshot is None:
                deleted = {"id": feed.sweep_id, "deleted": True}
                yield {"event": "end", "data": json.dumps(deleted)}
                return
            sweep, states = snapshot
            if previous is None:
                yield {"event": "progress", "data": sweep.model_dump_json()}
            elif states is not previous:
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
    finally:
        slot.release()


def _exists(factory: sessionmaker[Session], sweep_id: int) -> bool:
    with factory() as session:
        return session.get(Sweep, sweep_id) is not None


async def sweep_events(
    sweep_id: SweepId,
    request: Request,
    poll_s: Annotated[
        float, Query(ge=0.05, le=60, description="Seconds between database polls.")
    ] = DEFAULT_POLL_S,
) -> EventSourceResponse:
    """Stream run state changes and progress of a sweep; the stream ends when the sweep does.

    Every stream of one sweep shares one poller. At most MAX_STREAMS streams per process and
    MAX_STREAMS_PER_CLIENT per client address are open at once: one more is 429 with
    Retry-After."""
    # Async, so the slot bookkeeping below runs on the event loop only (no locks); the
    # existence check uses the streams' poll threads like every other query of theirs.
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    limiter = _poll_limiter(request.app.state)
    if not await anyio.to_thread.run_sync(_exists, factory, sweep_id, limiter=limiter):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} not found")
    slots = stream_slots(request.app.state)
    client = request.client.host if request.client is not None else "unknown"
    slot = slots.open(request.app.state, client, sweep_id)
    return EventSourceResponse(
        _stream(slot, poll_s), ping=PING_S, background=BackgroundTask(slot.release)
    )
