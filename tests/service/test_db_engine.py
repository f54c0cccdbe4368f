"""SQLite engines: connections that open a fresh database file at the same instant (the API and
the scheduler at first start) all get a WAL database and none fails with "database is locked"."""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy import text

from service.db.engine import make_engine


def _open_and_write(url: str, barrier: threading.Barrier, errors: list[str]) -> None:
    engine = make_engine(url)
    try:
        barrier.wait()
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS t (x INTEGER)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
    except Exception as exc:  # collected and asserted on below, with every thread's error
        errors.append(repr(exc))
    finally:
        engine.dispose()


def test_concurrent_first_connections_to_a_fresh_sqlite_file(tmp_path: Path) -> None:
    # One try races in ~1 of 9 without the retry of the WAL switch; 60 tries all pass with it.
    for i in range(60):
        url = f"sqlite:///{tmp_path / f'fresh{i}.db'}"
        errors: list[str] = []
        barrier = threading.Barrier(3)
        threads = [
            threading.Thread(target=_open_and_write, args=(url, barrier, errors)) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], f"try {i}: {errors}"
        engine = make_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 3
        engine.dispose()
