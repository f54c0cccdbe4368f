"""`ringlab watch` rides out a database outage: it honours Retry-After and keeps following
while the service's database is unreachable (its requests then reach a port where nothing
listens), and gives up with one line once the outage outlasts --patience."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from _api_helpers import small_spec
from _web_helpers import live_server, make_web_app
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from service.core.config import Settings

DEAD = "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2"
RINGLAB = str(Path(sys.executable).parent / "ringlab")


@contextmanager
def outage(app: Any) -> Iterator[None]:
    """The app's database unreachable until the block ends."""
    working, dead = app.state.sessionmaker, create_engine(DEAD)
    app.state.sessionmaker = sessionmaker(dead)
    try:
        yield
    finally:
        app.state.sessionmaker = working
        dead.dispose()


def _watch(base: str, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`ringlab watch *args` started, and the list its stderr lines are read into."""
    env = {**os.environ, "RINGLAB_URL": base, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [RINGLAB, "watch", *args], env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stderr is not None
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    return proc, lines


def _wait_for(lines: list[str], needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := [x for x in lines if needle in x]:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in {lines}")


def test_watch_follows_through_an_outage_of_the_stream(database_url: str) -> None:
    app = make_web_app(Settings(database_url=database_url))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep = http.post("/api/v1/sweeps", json=small_spec()).json()["id"]
        proc, lines = _watch(base, str(sweep))
        try:
            time.sleep(3)  # following: its stream is open
            with outage(app):
                waited = _wait_for(lines, "trying again for up to", 30)
            assert "database unavailable (OperationalError: " in waited, waited
            assert http.post(f"/api/v1/sweeps/{sweep}/cancel").status_code == 200
            stdout, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, lines
    assert f"sweep {sweep} ended: cancelled 4" in stdout, stdout


def test_watch_gives_up_after_its_patience_with_one_line(tmp_path: Path) -> None:
    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}"))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep = http.post("/api/v1/sweeps", json=small_spec()).json()["id"]
        with outage(app):
            start = time.monotonic()
            proc, lines = _watch(base, str(sweep), "--patience", "7")
            proc.wait(timeout=60)
            took = time.monotonic() - start
    assert proc.returncode == 1
    waits = [x for x in lines if "trying again" in x]
    assert len(waits) == 2, lines  # Retry-After 5: at 0 s and 5 s, then 7 s have passed
    last = lines[-1].strip()
    assert last.startswith(f"error: gave up after 7 s: GET /api/v1/sweeps/{sweep} -> 503: "), lines
    assert "database unavailable (OperationalError: " in last, last
    assert 7 <= took < 20, took
