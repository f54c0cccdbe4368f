"""Event streams cannot stall the service: 50 open streams whose database polls are slow (as on
a 100,000-run sweep) leave /healthz and a sweep POST answering at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _api_helpers import small_spec
from _web_helpers import live_server

from service.api import events
from service.app import create_app
from service.core.config import Settings

API = "/api/v1"
STREAMS = 50
POLL_S = 1.0  # each poll of every stream holds its thread this long


def test_fifty_slow_streams_leave_requests_answering(tmp_path: Path, monkeypatch: Any) -> None:
    real_poll = events._poll

    def slow_poll(*args: Any) -> Any:  # the database work of a very large sweep
        time.sleep(POLL_S)
        return real_poll(*args)

    monkeypatch.setattr(events, "_poll", slow_poll)
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'ringlab.db'}"))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep_id = http.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        stop = threading.Event()
        _open_streams(base, sweep_id, STREAMS, stop, poll_s=0.05)
        time.sleep(2 * POLL_S)  # every stream is polling now
        try:
            started = time.monotonic()
            assert http.get(f"{API}/healthz").status_code == 200
            health_s = time.monotonic() - started
            started = time.monotonic()
            assert http.post(f"{API}/sweeps", json=small_spec(name="while")).status_code == 201
            post_s = time.monotonic() - started
        finally:
            stop.set()
        # Without a limiter the 50 polls hold the request thread pool (40): both would wait
        # for a poll to finish (about POLL_S). With it they wait for nothing.
        assert health_s < POLL_S / 2, health_s
        assert post_s < POLL_S, post_s
    assert events.STREAM_POLL_THREADS < 40


@pytest.fixture(autouse=True)
def _short(monkeypatch: Any) -> None:
    monkeypatch.setattr(events, "PING_S", 1)


def _open_streams(
    base: str, sweep_id: int, n: int, stop: threading.Event, poll_s: float = 0.1
) -> list[Any]:
    """n readers of the sweep's events, each holding its stream open until `stop`."""
    opened = threading.Semaphore(0)

    def reader() -> None:
        url = f"{base}{API}/sweeps/{sweep_id}/events"
        with httpx.stream("GET", url, params={"poll_s": poll_s}, timeout=60) as response:
            assert response.status_code == 200
            opened.release()
            for _ in response.iter_bytes():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert opened.acquire(timeout=60)
    return threads


def test_streams_of_one_sweep_share_one_poller(tmp_path: Path) -> None:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'ringlab.db'}"))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep_id = http.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        stop = threading.Event()
        threads = _open_streams(base, sweep_id, 10, stop)
        feed = app.state.stream_slots.feeds[sweep_id]
        before, started = feed.polls, time.monotonic()
        time.sleep(2.0)
        polls, elapsed = feed.polls - before, time.monotonic() - started
        stop.set()
        # Ten streams polling every 0.1 s alone would poll 200 times in 2 s.
        assert polls <= elapsed / 0.1 + 2, polls
        assert feed.streams == 10
        for t in threads:
            t.join(timeout=10)
        # A client that went away gives its slot back; the feed goes with its last stream.
        deadline = time.monotonic() + 10
        while app.state.stream_slots.total and time.monotonic() < deadline:
            http.get(f"{API}/healthz")  # the server notices a closed stream when it writes
            time.sleep(0.2)
        assert app.state.stream_slots.total == 0 and sweep_id not in app.state.stream_slots.feeds


@pytest.mark.parametrize(("cap", "which"), [("MAX_STREAMS_PER_CLIENT", 3), ("MAX_STREAMS", 4)])
def test_one_stream_over_the_cap_is_429_with_retry_after(
    tmp_path: Path, monkeypatch: Any, cap: str, which: int
) -> None:
    monkeypatch.setattr(events, cap, which)
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'ringlab.db'}"))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep_id = http.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        stop = threading.Event()
        threads = _open_streams(base, sweep_id, which, stop)
        refused = http.get(f"{API}/sweeps/{sweep_id}/events")
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == str(events.RETRY_AFTER_S)
        assert f"{which} event streams are open" in refused.json()["detail"]
        assert http.get(f"{API}/healthz").status_code == 200  # everything else still answers
        stop.set()
        for t in threads:
            t.join(timeout=10)
        deadline = time.monotonic() + 10
        while app.state.stream_slots.total and time.monotonic() < deadline:
            time.sleep(0.2)
        with httpx.stream("GET", f"{base}{API}/sweeps/{sweep_id}/events", timeout=30) as again:
            assert again.status_code == 200  # the slots were given back


def test_the_event_stream_rides_out_a_database_outage(database_url: str) -> None:
    """The database becomes unreachable under an open stream (its polls reach a port where
    nothing listens): the stream sends `error` with the reason and `retry:`, stays open, and
    once the database is back goes on to the sweep's `end` on the same connection."""
    import json

    import httpx
    from _api_helpers import small_spec
    from _web_helpers import live_server, make_web_app
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from service.core.config import Settings

    app = make_web_app(Settings(database_url=database_url))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep = http.post("/api/v1/sweeps", json=small_spec()).json()["id"]
        working = app.state.sessionmaker
        dead = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2")
        blocks: list[str] = []
        timeout = httpx.Timeout(30, read=20)
        with http.stream("GET", f"/api/v1/sweeps/{sweep}/events?poll_s=0.1", timeout=timeout) as r:
            block: list[str] = []
            for line in r.iter_lines():
                if line:
                    block.append(line)
                    continue
                if not block or block[0].startswith(":"):
                    block = []
                    continue
                blocks.append("\n".join(block))
                event = block[0].removeprefix("event: ")
                if event == "progress" and len(blocks) == 1:
                    app.state.sessionmaker = sessionmaker(dead)  # the outage begins
                elif event == "error":
                    app.state.sessionmaker = working  # and ends; the sweep is then cancelled
                    assert http.post(f"/api/v1/sweeps/{sweep}/cancel").status_code == 200
                elif event == "end":
                    break
                block = []
        dead.dispose()
    events = [b.splitlines()[0].removeprefix("event: ") for b in blocks]
    assert events[0] == "progress" and events[1] == "error" and events[-1] == "end", events
    error = blocks[1].splitlines()
    assert "retry: 5000" in error, error
    data = json.loads(next(x for x in error if x.startswith("data: ")).removeprefix("data: "))
    assert data["detail"].startswith("database unavailable (OperationalError: "), data
    assert data["retry_after_s"] == 5
    end = json.loads(blocks[-1].splitlines()[1].removeprefix("data: "))
    assert end["counts"]["cancelled"] == 4 and end["done"], end
