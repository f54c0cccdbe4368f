"""A sweep's shared config is stored once: runs keep only what differs, every reader (run page,
run list, results, the scheduler's claim) still sees each run's whole config, and a sweep whose
expansion fails after thousands of valid cells stores nothing."""

from __future__ import annotations

import json
from typing import Any

from _api_helpers import api_client
from sqlalchemy import func, select, text

from service import leases
from service.api.store import INSERT_CHUNK
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import downgrade, upgrade
from service.db.models import Run, Sweep
from service.spec import SweepSpec, expand

API = "/api/v1"
ENV = {f"NCCL_X{i}": "x" * 200 for i in range(30)}  # 6 KB, under the caps, the same for all


def spec(lengths: list[int]) -> dict[str, Any]:
    base = {"kernel": "dense", "num_heads": 2, "head_dim": 16, "device": "cpu", "env": ENV}
    return {"name": "shared", "base": base, "grid": {"seq_len": lengths, "batch_size": [1, 2]}}


def test_shared_config_is_stored_once_and_read_whole(database_url: str) -> None:
    body = spec([64 * (i + 1) for i in range(100)])
    want = {c.cell_key: c.config_json for c in expand(SweepSpec.model_validate(body))}
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=body)
        assert r.status_code == 201 and r.json()["total"] == 200
        engine = make_engine(database_url)
        try:
            with engine.connect() as conn:
                stored = conn.execute(text("SELECT config FROM run")).scalars().all()
                base = conn.execute(text("SELECT base_config FROM sweep")).scalar_one()
            # What the database holds: env once in the sweep, never in a run.
            assert all("env" not in (c if isinstance(c, dict) else {}) for c in stored)
            assert '"env"' not in "".join(map(str, stored)) and base is not None
            # Every reader sees the whole config.
            page = client.get(f"{API}/runs", params={"limit": 1000}).json()["data"]
            assert {r["cell_key"]: r["config"] for r in page} == want
            one = client.get(f"{API}/runs/{page[0]['id']}").json()
            assert one["config"] == want[one["cell_key"]] and one["config"]["env"] == ENV
            rows = client.get(f"{API}/sweeps/{r.json()['id']}/results.json").json()
            assert len(rows) == 200
            sm = make_sessionmaker(engine)
            claim = leases.claim_next(sm, "test", lease_s=30)
            assert claim is not None
            with sm() as session:
                key = session.scalar(select(Run.cell_key).where(Run.id == claim.run_id))
            assert claim.config == want[key]
        finally:
            engine.dispose()


def test_an_invalid_cell_after_thousands_of_valid_ones_stores_nothing(database_url: str) -> None:
    lengths = [64 * (i + 1) for i in range(INSERT_CHUNK)] + [-64]  # chunks inserted, then one bad
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=spec(lengths))
        assert r.status_code == 422, r.text[:300]
        locs = {tuple(e["loc"][:3]) for e in r.json()["detail"]}
        assert ("body", "grid", "seq_len") in locs, locs
        engine = make_engine(database_url)
        try:
            with make_sessionmaker(engine)() as session:
                assert session.scalar(select(func.count()).select_from(Sweep)) == 0
                assert session.scalar(select(func.count()).select_from(Run)) == 0
        finally:
            engine.dispose()


def test_downgrade_gives_runs_their_whole_config_back(database_url: str) -> None:
    """Down to 0004 and up again: every run keeps its whole config and none is lost (on
    SQLite a rebuilt sweep table would have cascaded its drop to every run)."""
    body = spec([64, 128])
    want = sorted(
        (c.config_json for c in expand(SweepSpec.model_validate(body))), key=lambda c: c["seq_len"]
    )
    with api_client(database_url) as client:
        assert client.post(f"{API}/sweeps", json=body).status_code == 201
    downgrade(database_url, "0004")
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            configs = conn.execute(text("SELECT config FROM run")).scalars().all()
    finally:
        engine.dispose()
    configs = [c if isinstance(c, dict) else json.loads(c) for c in configs]
    assert sorted(configs, key=order) == sorted(want, key=order)
    upgrade(database_url)
    with api_client(database_url) as client:
        page = client.get(f"{API}/runs").json()["data"]
    assert sorted((r["config"] for r in page), key=order) == sorted(want, key=order)


def order(config: dict[str, Any]) -> tuple[int, int]:
    return config["seq_len"], config["batch_size"]


def test_a_cell_keeps_a_value_that_only_equals_the_base_in_python() -> None:
    """1, 1.0 and true are equal in Python but not the same JSON: a cell differing from the
    base only that way keeps its own value, so its config reads back as it was."""
    from service.db.models import cell_delta, full_config

    base = {"params": {"x": 1}, "flag": True, "rate": 1, "same": [1, {"a": 2}]}
    for config in (
        {"params": {"x": 1.0}, "flag": True, "rate": 1, "same": [1, {"a": 2}]},
        {"params": {"x": 1}, "flag": 1, "rate": True, "same": [1, {"a": 2.0}]},
    ):
        back = full_config(base, cell_delta(base, config))
        assert json.dumps(back, sort_keys=True) == json.dumps(config, sort_keys=True)
    assert cell_delta(base, dict(base)) == {}


def test_values_that_copy_escapes_are_stored_as_given(database_url: str) -> None:
    """A backslash, a tab, quotes and non-ASCII text in a value that varies by cell (so it is
    in each run's own row, written by COPY on Postgres) read back exactly."""
    values = [{"NCCL_A": "c:\\path\\n\tx"}, {"NCCL_A": 'q"uote \\t é ✓'}]
    body = {
        "name": "escapes",
        "base": {"kernel": "dense", "num_heads": 2, "head_dim": 16, "seq_len": 64},
        "grid": {"env": values, "batch_size": [1, 2]},
    }
    with api_client(database_url) as client:
        assert client.post(f"{API}/sweeps", json=body).status_code == 201
        page = client.get(f"{API}/runs", params={"limit": 10}).json()["data"]
    assert sorted(json.dumps(r["config"]["env"]) for r in page) == sorted(
        json.dumps(v) for v in values for _ in (1, 2)
    )
