"""Run and sweep lists at depth: cursors walk every row exactly once in every sort order, a page
by `skip` is the page by cursor in one statement with its count, counts stop at their cap and say
so, bad parameters are a 422 naming them, and on Postgres every filter the API offers has an index
to use, from which an offset page reads only its own entries (EXPLAIN)."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from _api_helpers import api_client
from fastapi.testclient import TestClient
from sqlalchemy import event, insert, text
from sqlalchemy.orm import Session

from service.api import pages, store
from service.api.deps import MAX_SKIP
from service.db.engine import make_engine
from service.db.models import Run, RunStatus, Sweep, SweepKind, utcnow

API = "/api/v1"
KERNELS = ("dense", "ring", "dilated")


def fill(database_url: str, runs: int, sweeps: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """`sweeps` sweeps and `runs` runs with mixed, repeating values and NULL start times;
    the runs as inserted, ids included."""
    rng = random.Random(seed)
    now = utcnow()
    engine = make_engine(database_url)
    rows: list[dict[str, Any]] = []
    try:
        with Session(engine) as session:
            session.execute(
                insert(Sweep),
                [
                    {"id": i + 1, "name": f"s{i}", "kind": SweepKind.benchmark, "spec": {}}
                    for i in range(sweeps)
                ],
            )
            for i in range(runs):
                started = rng.random() < 0.6
                rows.append(
                    {
                        "id": i + 1,
                        "sweep_id": rng.randrange(sweeps) + 1,
                        "cell_key": f"k{i}",
                        "cell_config": {},
                        "kernel": rng.choice(KERNELS),
                        "seq_len": rng.choice((1024, 2048, 4096)),
                        "world_size": rng.choice((1, 2, 4)),
                        "dtype": rng.choice(("float32", "bfloat16")),
                        "mode": "forward",
                        "causal": False,
                        "status": rng.choice(list(RunStatus)),
                        "attempts": rng.randrange(3),
                        "created_at": now,
                        # Few distinct values, many ties: the id must break them.
                        "started_at": now + timedelta(seconds=rng.randrange(5))
                        if started
                        else None,
                    }
                )
            if rows:
                session.execute(insert(Run), rows)
            session.commit()
    finally:
        engine.dispose()
    return rows


def walk(client: TestClient, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of a list, following `next` until it is null."""
    seen: list[dict[str, Any]] = []
    cursor = None
    for _ in range(1000):
        page = client.get(path, params={**params, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        seen += body["data"]
        cursor = body["next"]
        if cursor is None:
            return seen
    raise AssertionError("the cursor never ended")


def expected_order(rows: list[dict[str, Any]], sort: str) -> list[int]:
    """Ids in the documented order: the sort column (NULLs last either way), then id."""
    key = sort.removeprefix("-")
    desc = sort.startswith("-")
    present = [r for r in rows if r[key] is not None]
    missing = [r for r in rows if r[key] is None]
    present.sort(key=lambda r: (str(r[key]) if key == "status" else r[key], r["id"]), reverse=desc)
    missing.sort(key=lambda r: r["id"], reverse=desc)
    return [r["id"] for r in present + missing]


SORTS = ("-id", "id", "seq_len", "-seq_len", "status", "started_at", "-started_at", "-kernel")


def test_cursor_walks_every_run_exactly_once_in_every_order(database_url: str) -> None:
    with api_client(database_url) as client:
        rows = fill(database_url, 230)
        for sort in SORTS:
            seen = walk(client, f"{API}/runs", {"sort": sort, "limit": 17})
            assert [r["id"] for r in seen] == expected_order(rows, sort), sort
        # With filters: only matching rows, still each once and in order.
        params = {"kernel": "ring", "world_size": 2, "sort": "-started_at", "limit": 7}
        seen = walk(client, f"{API}/runs", params)
        want = [r for r in rows if r["kernel"] == "ring" and r["world_size"] == 2]
        assert [r["id"] for r in seen] == expected_order(want, "-started_at")
        assert len(want) > 7  # several pages were walked


def test_offset_pages_are_the_same_rows_in_every_order(database_url: str) -> None:
    """A page by `skip` (the deferred join: ids first, then whole rows) is exactly the slice of
    the documented order, filtered or not; `count=false` answers the same rows with a null
    count and the same `next`."""
    with api_client(database_url) as client:
        rows = fill(database_url, 230)
        ring = [r for r in rows if r["kernel"] == "ring"]
        for sort in SORTS:
            for params, want in (({}, rows), ({"kernel": "ring"}, ring)):
                order = expected_order(want, sort)
                for skip in (0, 13, len(order) - 5):
                    query = {**params, "sort": sort, "skip": skip, "limit": 11}
                    body = client.get(f"{API}/runs", params=query).json()
                    assert [r["id"] for r in body["data"]] == order[skip : skip + 11], query
                    assert (body["count"], body["count_exact"]) == (len(order), True)
                    bare = client.get(f"{API}/runs", params={**query, "count": "false"}).json()
                    assert bare["data"] == body["data"] and bare["next"] == body["next"]
                    assert (bare["count"], bare["count_exact"]) == (None, False)
        bad = client.get(f"{API}/runs", params={"count": "maybe"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "count"]


def test_counts_stop_at_the_cap_and_say_so(database_url: str) -> None:
    with api_client(database_url) as client:
        rows = fill(database_url, pages.COUNT_CAP + 40, sweeps=1)
        body = client.get(f"{API}/runs", params={"limit": 5}).json()
        assert (body["count"], body["count_exact"]) == (pages.COUNT_CAP, False)
        ring = sum(r["kernel"] == "ring" for r in rows)
        assert ring < pages.COUNT_CAP
        body = client.get(f"{API}/runs", params={"kernel": "ring", "limit": 5}).json()
        assert (body["count"], body["count_exact"]) == (ring, True)
        # The last page says there is no next one.
        body = client.get(f"{API}/runs", params={"sweep_id": 1, "limit": 1000, "sort": "id"})
        last = walk(client, f"{API}/runs", {"kernel": "ring", "sort": "id", "limit": 1000})
        assert len(last) == ring and body.json()["next"] is not None


def test_sweep_list_pages_by_cursor(database_url: str) -> None:
    with api_client(database_url) as client:
        fill(database_url, 0, sweeps=12)
        seen = walk(client, f"{API}/sweeps", {"limit": 5})
        assert [s["id"] for s in seen] == list(range(12, 0, -1))
        first = client.get(f"{API}/sweeps", params={"limit": 5}).json()
        assert (first["count"], first["count_exact"]) == (12, True)


def b64(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"cursor": "not a cursor"}, "not a cursor from a previous page"),
        ({"cursor": b64(["-id", "x", 1])}, "not a cursor from a previous page"),
        ({"cursor": b64(["-id", 5, "1"])}, "not a cursor from a previous page"),
        ({"cursor": b64(["status", "bogus", 1]), "sort": "status"}, "not a cursor"),
        ({"cursor": b64(["seq_len", None, 1]), "sort": "seq_len"}, "not a cursor"),
        ({"cursor": b64(["started_at", "yesterday", 1]), "sort": "started_at"}, "not a"),
        ({"cursor": b64({"a": 1})}, "not a cursor from a previous page"),
        ({"cursor": b64(["-id", 10**20, 10**20])}, "not a cursor from a previous page"),
        ({"cursor": b64(["seq_len", 2**63, 1]), "sort": "seq_len"}, "not a cursor"),
        ({"cursor": b64(["kernel", "a\x00", 1]), "sort": "kernel"}, "not a cursor"),
        ({"cursor": "e30"}, "not a cursor from a previous page"),
    ],
)
def test_a_forged_cursor_is_a_422_naming_it(
    tmp_path: Any, params: dict[str, str], reason: str
) -> None:
    with api_client(f"sqlite:///{tmp_path / 'r.db'}") as client:
        r = client.get(f"{API}/runs", params=params)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["query", "cursor"] and reason in err["msg"]


def test_a_cursor_of_another_sort_or_a_deep_skip_is_refused(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with api_client(url) as client:
        fill(url, 30)
        cursor = client.get(f"{API}/runs", params={"sort": "seq_len", "limit": 5}).json()["next"]
        r = client.get(f"{API}/runs", params={"sort": "-id", "cursor": cursor})
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["query", "cursor"]
        assert "made for sort='seq_len'" in r.json()["detail"][0]["msg"]
        r = client.get(f"{API}/runs", params={"skip": 10_001})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "skip"]
        r = client.get(f"{API}/sweeps", params={"cursor": "x" * 401})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "cursor"]
        r = client.get("/", params={"page": 202, "per_page": 50})  # the dashboard's list
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "page"]
        assert client.get("/", params={"page": 201, "per_page": 50}).status_code == 200


FILTERS: list[store.RunFilter] = [
    store.RunFilter(sweep_id=1),
    store.RunFilter(kernel="ring"),
    store.RunFilter(status=RunStatus.failed),
    store.RunFilter(world_size=2),
    store.RunFilter(dtype="bfloat16"),
    store.RunFilter(seq_len_min=2048, seq_len_max=4096),
    store.RunFilter(kernel="dense", status=RunStatus.queued, world_size=1),
    store.RunFilter(sweep_id=2, status=RunStatus.succeeded),
]


INDEXED_SORTS = ("-id", "seq_len", "-seq_len", "-world_size", "kernel", "status", "-dtype")
"""Unfiltered pages in these orders walk an index too (times and attempts sort a filtered
set: an index each would slow every sweep's insert for a rarely used order)."""


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_every_filter_has_an_index_on_postgres(database_url: str) -> None:
    """With sequential scans priced out, every filtered page still plans without reading the
    whole run table: an index matches each filter the API offers (and each sort it pages by,
    where no filter is given)."""
    with api_client(database_url):
        fill(database_url, 2000)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE run"))
            conn.execute(text("SET enable_seqscan = off"))
            queries = [(f, "-id") for f in FILTERS]
            queries += [(store.RunFilter(), s) for s in INDEXED_SORTS]
            for filters, sort in queries:
                stmt = store.page_query(filters, sort, limit=50)
                sql = stmt.compile(engine, compile_kwargs={"literal_binds": True})
                plan = "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {sql}")))
                assert "Seq Scan on run" not in plan, (filters, sort, plan)
    finally:
        engine.dispose()


LISTINGS: list[dict[str, Any]] = [
    {},
    {"kernel": "dense", "status": "queued", "world_size": 1},
    {"kernel": "dense", "status": "succeeded", "world_size": 2, "sort": "-seq_len"},
    {"kernel": "dense"},
    {"status": "failed", "sort": "-seq_len"},
    {"status": "failed"},
    {"seq_len_min": 2048, "seq_len_max": 4096, "dtype": "bfloat16", "sort": "seq_len"},
    {"sweep_id": 1},
    {"sweep_id": 2, "status": "succeeded"},
]
"""The listings bench/service.py times (a researcher's filters and orders; -id unless said)."""


@contextmanager
def run_statements(client: TestClient) -> Iterator[list[str]]:
    """The SQL statements that read the run table while the block runs (the app's engine)."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if " run" in statement.lower():
            seen.append(statement)

    engine = client.app.state.engine  # type: ignore[attr-defined]
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_a_page_by_offset_is_the_page_by_cursor_and_one_statement(database_url: str) -> None:
    """Every listing walked by `next` and read by `skip` gives the same pages with the same
    count; a page costs one statement whether counted or not (the count rides on its rows),
    and count=false leaves the count out of the SQL altogether."""
    with api_client(database_url) as client:
        fill(database_url, 600)
        for params in LISTINGS:
            query = {**params, "limit": 4}
            by_cursor = walk(client, f"{API}/runs", query)
            count = client.get(f"{API}/runs", params=query).json()["count"]
            assert count == len(by_cursor) > 4, params  # several pages to compare
            starts = range(0, len(by_cursor), 4)
            for skip in {*starts[:: max(1, len(starts) // 5)], starts[-1]}:
                with run_statements(client) as sql:
                    page = client.get(f"{API}/runs", params={**query, "skip": skip}).json()
                assert page["data"] == by_cursor[skip : skip + 4], (params, skip)
                assert (page["count"], page["count_exact"]) == (count, True)
                assert len(sql) == 1 and sql[0].lower().count("count(") == 1, sql
            with run_statements(client) as sql:
                bare = client.get(f"{API}/runs", params={**query, "count": "false"}).json()
            assert bare["data"] == by_cursor[:4] and bare["count"] is None
            assert len(sql) == 1 and "count(" not in sql[0].lower(), sql


def test_a_page_past_the_end_still_counts_once(database_url: str) -> None:
    """An empty page has no row to carry the count: it is then counted on its own, once."""
    with api_client(database_url) as client:
        rows = fill(database_url, 40)
        ring = sum(r["kernel"] == "ring" for r in rows)
        for params, want in (({"kernel": "ring", "skip": 500}, ring), ({"kernel": "x"}, 0)):
            with run_statements(client) as sql:
                page = client.get(f"{API}/runs", params=params).json()
            assert (page["data"], page["count"], page["count_exact"]) == ([], want, True)
            assert [s.lower().count("count(") for s in sql] == [1, 1], sql


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("skip", -1),
        ("skip", MAX_SKIP + 1),
        ("limit", 0),
        ("limit", 1001),
        ("sort", "config"),
        ("sort", "--id"),
        ("status", "done"),
        ("dtype", "int8"),
        ("world_size", 0),
        ("count", "twice"),
        ("cursor", "%%%"),
    ],
)
def test_a_bad_page_parameter_is_a_422_naming_it(tmp_path: Any, field: str, value: Any) -> None:
    with api_client(f"sqlite:///{tmp_path / 'r.db'}") as client:
        r = client.get(f"{API}/runs", params={field: value})
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [["query", field]]


def id_scan(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan node that reads the page's ids (the scan of run aliased run_1: page_query's
    deferred join reads whole rows from the outer `run` only for the page's ids)."""
    if plan.get("Alias") == "run_1":
        return plan
    for child in plan.get("Plans", []):
        found = id_scan(child)
        if found:
            return found
    return {}


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_offset_pages_read_only_their_index_entries_on_postgres(database_url: str) -> None:
    """Each listing's ids come from one index in the page's order (no sort), read from the
    index alone (no heap fetch), stopping after skip + limit + 1 entries: `skip` costs index
    entries, never table rows, and none of another filter's (EXPLAIN ANALYZE; sorts and
    sequential scans priced out, so what is asserted is that such an index exists)."""
    with api_client(database_url):
        fill(database_url, 3000)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE run"))
            for setting in ("enable_seqscan", "enable_bitmapscan", "enable_sort"):
                conn.execute(text(f"SET {setting} = off"))
            for params in LISTINGS:
                filters = {k: v for k, v in params.items() if k != "sort"}
                sort = params.get("sort", "-id")
                stmt = store.page_query(store.RunFilter(**filters), sort, limit=10, skip=20)
                sql = stmt.compile(engine, compile_kwargs={"literal_binds": True})
                (plan,) = conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")).scalar()
                scan = id_scan(plan["Plan"])
                assert scan["Node Type"] == "Index Only Scan", (params, plan)
                assert scan["Heap Fetches"] == 0 and scan["Actual Rows"] == 31, (params, scan)
                assert scan.get("Rows Removed by Filter", 0) == 0, (params, scan)
    finally:
        engine.dispose()
