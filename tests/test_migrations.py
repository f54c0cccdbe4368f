"""One Alembic history serves SQLite and Postgres, and matches the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from service.db.engine import make_engine
from service.db.migrate import current, downgrade, upgrade
from service.db.models import Base

TABLES = {"sweep", "run", "rank_result", "probe", "environment"}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    upgrade(database_url)
    assert _tables(database_url) == TABLES
    head = current(database_url)
    assert head is not None

    downgrade(database_url, "base")
    assert _tables(database_url) == set()
    assert current(database_url) is None

    upgrade(database_url)
    assert _tables(database_url) == TABLES
    assert current(database_url) == head


def test_models_match_migrations(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"
