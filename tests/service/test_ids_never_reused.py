"""Ids are never reused: a deleted sweep's (and its runs') ids name no later sweep or run, on
SQLite (AUTOINCREMENT, revision 0021) and Postgres; the migration keeps every row and id."""

from __future__ import annotations

import datetime as dt
from typing import Any

from _api_helpers import api_client, small_spec
from sqlalchemy import JSON, Boolean, DateTime, Enum, Float, MetaData, String, insert, select

from service.db.engine import make_engine
from service.db.migrate import downgrade, upgrade

API = "/api/v1"
BEFORE = "0020_device_used"
REVISION = "0021_autoincrement"


def _run_ids(client: Any, sweep_id: int) -> list[int]:
    runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()
    return [r["id"] for r in runs["data"]]


def test_a_deleted_sweeps_ids_go_to_no_later_sweep_or_run(database_url: str) -> None:
    with api_client(database_url) as client:
        client.post(f"{API}/sweeps", json=small_spec("first"))
        newest = client.post(f"{API}/sweeps", json=small_spec("second")).json()["id"]
        newest_runs = _run_ids(client, newest)
        client.post(f"{API}/sweeps/{newest}/cancel")
        assert client.delete(f"{API}/sweeps/{newest}").status_code == 204

        again = client.post(f"{API}/sweeps", json=small_spec("third")).json()["id"]
        assert again > newest
        assert min(_run_ids(client, again)) > max(newest_runs)


def _value(column: Any, i: int) -> Any:
    """A value of `column`'s type for row i (every required column of every table filled)."""
    kind = column.type
    if isinstance(kind, Enum):
        return kind.enums[0]
    if isinstance(kind, DateTime):
        return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i)
    if isinstance(kind, Boolean):
        return True
    if isinstance(kind, JSON):
        return {"row": i}
    if isinstance(kind, String):
        return f"{column.name}-{i}"
    if isinstance(kind, Float):
        return 0.5 + i
    return i


PARENTS = {"sweep_id": "sweep", "run_id": "run", "environment_id": "environment"}
ORDER = ("environment", "sweep", "run", "rank_result", "probe", "memory_component")
ORDER += ("ring_step", "artifact", "web_session")


def _fill(url: str) -> None:
    """Rows in every table, with gaps in the ids (as deletions leave them)."""
    engine = make_engine(url)
    meta = MetaData()
    meta.reflect(engine)
    with engine.begin() as conn:
        for name in ORDER:
            table = meta.tables[name]
            rows = []
            for i in (3, 7, 8):
                row = {c.name: _value(c, i) for c in table.columns}
                row.update({c: 7 for c in PARENTS if c in table.columns})
                rows.append(row)
            conn.execute(insert(table), rows)
            if conn.dialect.name == "postgresql":  # as if the sequence had handed them out
                conn.exec_driver_sql(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), 8)")
    engine.dispose()


def _dump(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = make_engine(url)
    meta = MetaData()
    meta.reflect(engine)
    with engine.connect() as conn:
        out = {
            name: [tuple(r) for r in conn.execute(select(table).order_by(table.c.id))]
            for name, table in meta.tables.items()
            if name != "alembic_version"
        }
    engine.dispose()
    return out


def _schema_sql(url: str, table: str) -> str:
    engine = make_engine(url)
    with engine.connect() as conn:
        sql = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).scalar_one()
    engine.dispose()
    return str(sql)


def test_the_migration_keeps_every_row_and_id_and_downgrades(database_url: str) -> None:
    upgrade(database_url, BEFORE)
    _fill(database_url)
    before = _dump(database_url)
    assert all(len(rows) == 3 for rows in before.values())

    upgrade(database_url, REVISION)
    assert _dump(database_url) == before
    sqlite = database_url.startswith("sqlite")
    if sqlite:
        for table in ("sweep", "run"):
            assert "AUTOINCREMENT" in _schema_sql(database_url, table)
    upgrade(database_url)  # the revisions after it add columns the API reads
    with api_client(database_url) as client:  # the next sweep and run follow the largest ids
        new = client.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        assert new > 8 and min(_run_ids(client, new)) > 8

    downgrade(database_url, BEFORE)
    after = _dump(database_url)  # the rows above, and the sweep and runs added since
    assert {name: rows[:3] for name, rows in after.items()} == before
    if sqlite:
        assert "AUTOINCREMENT" not in _schema_sql(database_url, "sweep")
