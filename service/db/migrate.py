"""Run Alembic migrations from the installed package, so they work from any directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, text

from service.db.engine import make_engine

MIGRATION_LOCK_KEY = 0x72696E676C6162  # "ringlab": the Postgres advisory lock upgrades take


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and the given database."""
    script_location = Path(str(files("service.migrations")))
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head", engine: Engine | None = None) -> None:
    """Bring the database at `url` to `revision` (default head)."""
    _migrate(command.upgrade, url, revision, engine)


def downgrade(url: str, revision: str = "base", engine: Engine | None = None) -> None:
    """Take the database at `url` back to `revision` (default base: empty)."""
    _migrate(command.downgrade, url, revision, engine)


def _migrate(
    step: Callable[[Config, str], None], url: str, revision: str, engine: Engine | None
) -> None:
    """Run an Alembic command in one transaction (on `engine`, or one made for `url`).

    On Postgres the transaction first takes an advisory lock: processes that start together
    (an API replica and a scheduler, say) migrate one after the other, and the later ones
    find the schema at head instead of failing on tables that already exist.
    """
    cfg = alembic_config(url)
    own = engine is None
    engine = make_engine(url) if engine is None else engine
    try:
        with engine.connect() as conn, _sqlite_foreign_keys_off(conn), conn.begin():
            if conn.dialect.name == "postgresql":
                lock = text("SELECT pg_advisory_xact_lock(:key)")
                conn.execute(lock, {"key": MIGRATION_LOCK_KEY})
            cfg.attributes["connection"] = conn
            step(cfg, revision)
            _check_foreign_keys(conn)
    finally:
        if own:
            engine.dispose()


@contextmanager
def _sqlite_foreign_keys_off(conn: Connection) -> Iterator[None]:
    """SQLite's foreign keys off while migrating, on again after (Postgres: nothing).

    A batch-mode rebuild drops the table's old copy, and with foreign keys on that drop
    deletes the rows of every table that refers to it (runs, then their results): SQLite's
    own procedure for rebuilding a table turns them off first. The pragma is a no-op inside a
    transaction, so it is set before the migration's transaction begins."""
    if conn.dialect.name != "sqlite":
        yield
        return
    conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
    conn.commit()
    try:
        yield
    finally:
        conn.rollback()  # whatever is left: the migration's transaction has ended
        conn.exec_driver_sql("PRAGMA foreign_keys=ON")
        conn.commit()


def _check_foreign_keys(conn: Connection) -> None:
    """On SQLite, refuse (and so roll back) a migration that left a row referring to none."""
    if conn.dialect.name != "sqlite":
        return
    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        raise RuntimeError(f"the migration left rows whose foreign keys refer to none: {broken}")


def current(url: str) -> str | None:
    """The revision the database is at, or None for an empty database."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
