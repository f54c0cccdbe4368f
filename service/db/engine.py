"""Engine and session factory with the per-backend settings every connection needs."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000


def _on_sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; busy_timeout waits instead of
    # failing with "database is locked"; SQLite leaves foreign keys off unless asked.
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    _set_wal(cur)
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _set_wal(cur: Any) -> None:
    """Switch the database to WAL, retrying while another connection holds it locked.

    Two connections that open a fresh (rollback-journal) file at once both read it and then
    both need the exclusive lock to change its mode; SQLite answers one of them "database is
    locked" at once, without its busy handler (waiting could deadlock). Once one switch has
    landed the mode is stored in the file, so the retry is a no-op.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for a normalized URL (see core.config.normalize_database_url)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
            **kwargs,
        )
        event.listen(engine, "connect", _on_sqlite_connect)
        return engine
    return create_engine(url, pool_pre_ping=True, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (results are read after writes)."""
    return sessionmaker(engine, expire_on_commit=False)


def rowcount(result: Any) -> int:
    """Rows an UPDATE or DELETE changed (Session.execute is typed as a plain Result)."""
    return cast(CursorResult[Any], result).rowcount


@contextmanager
def scratch_schema(base_url: str, prefix: str) -> Iterator[str]:
    """A URL on the Postgres database `base_url` (normalized) whose every connection uses a new,
    empty schema named `prefix` + 16 hex digits; the schema is dropped afterwards.

    libpq's options parameter sets search_path for every pooled connection, so the models,
    Alembic's version table and raw SQL all land in that schema (tests, benchmarks)."""
    schema = f"{prefix}{uuid.uuid4().hex[:16]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        sep = "&" if "?" in base_url else "?"
        yield f"{base_url}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
