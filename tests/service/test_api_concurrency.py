"""20 concurrent clients submit and read against a live server, on SQLite and on Postgres."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from _api_helpers import small_spec
from _web_helpers import live_server
from sqlalchemy import func, select

from service.app import create_app
from service.core.config import Settings
from service.db.models import Run, Sweep

CLIENTS = 20
API = "/api/v1"


def _client_session(base: str, n: int) -> list[tuple[str, int, str]]:
    """One client's work: its own sweep (sent twice), the shared sweep, and reads in between."""
    seen: list[tuple[str, int, str]] = []
    with httpx.Client(base_url=base, timeout=60) as http:

        def record(r: httpx.Response) -> httpx.Response:
            seen.append((f"{r.request.method} {r.request.url.path}", r.status_code, r.text))
            return r

        own = small_spec(f"client-{n}")
        key = {"Idempotency-Key": f"client-{n}"}
        first = record(http.post(f"{API}/sweeps", json=own, headers=key))
        record(http.get(f"{API}/sweeps", params={"limit": 5}))
        record(
            http.post(
                f"{API}/sweeps", json=small_spec("shared"), headers={"Idempotency-Key": "shared"}
            )
        )
        if first.status_code == 201:
            sweep_id = first.json()["id"]
            record(http.get(f"{API}/runs", params={"sweep_id": sweep_id}))
            record(http.get(f"{API}/sweeps/{sweep_id}"))
            record(http.get(f"{API}/sweeps/{sweep_id}/results.json"))
        again = record(http.post(f"{API}/sweeps", json=own, headers=key))
        assert again.status_code != 200 or again.json()["id"] == first.json()["id"]
    return seen


@pytest.mark.timeout(300)
def test_concurrent_clients_store_each_sweep_once(database_url: str) -> None:
    app = create_app(Settings(database_url=database_url))
    with live_server(app) as base, ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda n: _client_session(base, n), range(CLIENTS)))
        responses: list[Any] = [r for client in results for r in client]
        bad = [r for r in responses if r[1] >= 300]
        locked = [r for r in responses if "locked" in r[2]]
        assert not bad and not locked, (bad + locked)[:3]
        statuses = sorted(code for what, code, _ in responses if what == f"POST {API}/sweeps")
        # own sweep: 201 then 200; shared: one 201 and 19 x 200
        assert statuses.count(201) == CLIENTS + 1 and statuses.count(200) == 2 * CLIENTS - 1
        with app.state.sessionmaker() as s:
            assert s.scalar(select(func.count()).select_from(Sweep)) == CLIENTS + 1
            assert s.scalar(select(func.count()).select_from(Run)) == (CLIENTS + 1) * 4
            names = s.scalars(select(Sweep.name)).all()
        assert sorted(names) == sorted([f"client-{n}" for n in range(CLIENTS)] + ["shared"])
