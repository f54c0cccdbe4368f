"""Event streams cannot stall the service: 50 open streams whose database polls are slow (as on
a 100,000-run sweep) leave /healthz and a sweep POST answering at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _api_helpers import live_server, small_spec

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
        opened = threading.Semaphore(0)
        stop = threading.Event()

        def reader() -> None:
            url = f"{base}{API}/sweeps/{sweep_id}/events"
            with httpx.stream("GET", url, params={"poll_s": 0.05}, timeout=60) as response:
                opened.release()
                for _ in response.iter_bytes():
                    if stop.is_set():
                        return

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(STREAMS)]
        for t in threads:
            t.start()
        for _ in range(STREAMS):
            assert opened.acquire(timeout=60)
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
