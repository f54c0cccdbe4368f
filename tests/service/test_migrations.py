"""One Alembic history serves SQLite and Postgres, and matches the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from service.db.engine import make_engine
from service.db.migrate import current, downgrade, upgrade
from service.db.models import Base

TABLES = {
    "ring_step",
    "artifact",
    "web_session",
    "sweep",
    "run",
    "rank_result",
    "probe",
    "environment",
    "memory_component",
}


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


def test_concurrent_upgrades_all_succeed(database_url: str) -> None:
    """Processes starting together each run `upgrade` (API replicas, a scheduler): on Postgres
    they serialize on an advisory lock, and every one of them ends at head without an error."""
    import subprocess
    import sys

    import pytest

    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite deployments migrate from one process (ringlab serve)")
    import time

    # Imports first, then every process starts migrating at the same instant.
    code = (
        "import sys, time; from service.db.migrate import upgrade; "
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); upgrade(sys.argv[1])"
    )
    start_at = str(time.time() + 4.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, database_url, start_at],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outputs)
    assert _tables(database_url) == TABLES and current(database_url) is not None
