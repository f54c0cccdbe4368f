"""A page of a sweep's rows, or a few chosen runs, reads as the whole sweep's rows do: the same
labels, baselines and ratios, although it reads only those runs and their baselines."""

from __future__ import annotations

from typing import Any

from _web_helpers import seed_sweeps
from sqlalchemy import select
from sqlalchemy.orm import Session
from test_report_tables import _dp_sweep, client_for

from service.db.engine import make_engine
from service.db.models import Sweep
from service.results import export, queries


def dicts(rows: list[Any]) -> list[dict[str, Any]]:
    return [r.as_dict() for r in rows]


def test_pages_and_chosen_runs_read_as_the_whole_sweep(database_url: str) -> None:
    seed_sweeps(database_url)
    with client_for(database_url) as client:
        _dp_sweep(client)  # world-size baselines, data and sequence parallel
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            sweeps = session.scalars(select(Sweep).order_by(Sweep.id)).all()
            assert len(sweeps) == 4
            for sweep in sweeps:
                whole = queries.sweep_rows(session, sweep)
                assert any(r.baseline_run_id for r in whole) or sweep.kind == "max_seq_len"
                paged: list[Any] = []
                after = 0
                while page := queries.rows_page(session, sweep, after=after, limit=2):
                    paged += page
                    after = page[-1].run_id
                assert dicts(paged) == dicts(whole), sweep.name
                chosen = [whole[-1].run_id, whole[0].run_id]
                picked = queries.rows_page(session, sweep, run_ids=chosen)
                assert dicts(picked) == dicts([whole[0], whole[-1]])
    finally:
        engine.dispose()


def test_the_context_pass_reads_in_chunks(database_url: str, monkeypatch: Any) -> None:
    """A context found 2 runs at a time equals one found at once (the chunk boundary is not a
    boundary of the sweep)."""
    with client_for(database_url) as client:
        runs = _dp_sweep(client)
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            sweep = session.get(Sweep, runs[0]["sweep_id"])
            assert sweep is not None
            queries._contexts.clear()
            once = queries.sweep_context(session, sweep)
            queries._contexts.clear()
            monkeypatch.setattr(queries, "CONTEXT_CHUNK", 2)
            chunked = queries.sweep_context(session, sweep)
            assert chunked == once and len(once.refs) > 2
    finally:
        engine.dispose()
        queries._contexts.clear()


def test_streamed_exports_cross_pages_unchanged(database_url: str, monkeypatch: Any) -> None:
    """results.json and results.csv streamed 2 runs a page equal the rows of the whole sweep."""
    from service.results import service as sweep_results

    monkeypatch.setattr(sweep_results, "EXPORT_PAGE", 2)
    with client_for(database_url) as client:
        runs = _dp_sweep(client)
        sweep_id = runs[0]["sweep_id"]
        with client.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
            sweep = session.get(Sweep, sweep_id)
            whole = [export.result_row(r) for r in queries.sweep_rows(session, sweep)]
        got = client.get(f"/api/v1/sweeps/{sweep_id}/results.json")
        assert got.status_code == 200 and got.headers["content-type"] == "application/json"
        want = [export.ResultRow(**r).model_dump(mode="json") for r in whole]
        assert got.json() == want and len(want) > 4
        csv = client.get(f"/api/v1/sweeps/{sweep_id}/results.csv").text
        assert csv == export.to_csv(whole)
        assert client.get("/api/v1/sweeps/999/results.json").status_code == 404


def test_dashboard_json_pages_and_changed_runs(database_url: str, monkeypatch: Any) -> None:
    from service.web import router

    with client_for(database_url) as client:
        runs = _dp_sweep(client)
        sweep_id, ids = runs[0]["sweep_id"], sorted(r["id"] for r in runs)
        whole = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()
        assert whole["whole"] and whole["next"] is None and whole["figures"]
        assert [r["run_id"] for r in whole["rows"]] == ids
        by_id = {r["run_id"]: r for r in whole["rows"]}
        some = client.get(f"/sweeps/{sweep_id}/dashboard.json?runs={ids[3]},{ids[1]}").json()
        assert some["rows"] == [by_id[ids[1]], by_id[ids[3]]]
        assert some["figures"] == whole["figures"]  # a small sweep's charts come along

        monkeypatch.setattr(router, "WHOLE_SWEEP_RUNS", 3)
        monkeypatch.setattr(router, "PAGE_RUNS", 4)
        first = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()
        assert not first["whole"] and first["figures"] is None
        assert [r["run_id"] for r in first["rows"]] == ids[:4] and first["next"] == ids[3]
        second = client.get(f"/sweeps/{sweep_id}/dashboard.json?after={first['next']}").json()
        assert second["rows"] == [by_id[i] for i in ids[4:8]]

        for bad, reason in (
            ("1,x", "string_pattern_mismatch"),
            (",".join(["1"] * 201), "201"),
            ("5,9999999999", "at most 2147483647"),
        ):
            r = client.get(f"/sweeps/{sweep_id}/dashboard.json?runs={bad}")
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "runs"]
            assert reason in r.text


def test_a_second_large_whole_sweep_read_waits_its_turn(
    database_url: str, monkeypatch: Any
) -> None:
    """report.md, pivot.csv and the compare page read a whole sweep: above LARGE_SWEEP_RUNS a
    process runs one at a time and answers another with 429 and Retry-After; smaller sweeps and
    the streamed exports never wait."""
    monkeypatch.setattr(queries, "LARGE_SWEEP_RUNS", 4)
    with client_for(database_url) as client:
        sweep_id = _dp_sweep(client)[0]["sweep_id"]
        assert client.get(f"/api/v1/sweeps/{sweep_id}/report.md").status_code == 200
        assert queries._large_reads.acquire(blocking=False)  # another large read is running
        try:
            for path in (
                f"/api/v1/sweeps/{sweep_id}/report.md",
                f"/api/v1/sweeps/{sweep_id}/pivot.csv",
                f"/compare?a={sweep_id}&b={sweep_id}",
            ):
                r = client.get(path)
                assert r.status_code == 429, (path, r.text)
                assert r.headers["Retry-After"] == "10"
                assert "results.csv streams any sweep" in r.json()["detail"]
            assert client.get(f"/api/v1/sweeps/{sweep_id}/results.csv").status_code == 200
            assert client.get(f"/sweeps/{sweep_id}").status_code == 200
        finally:
            queries._large_reads.release()
        assert client.get(f"/api/v1/sweeps/{sweep_id}/report.md").status_code == 200


def test_the_results_routes_answer_a_missing_sweep_404_and_a_bad_pivot_422(
    database_url: str,
) -> None:
    """Each results route reads its sweep through the results service: a sweep that is not
    there is a 404 naming it, a pivot override that makes no pivot a 422 at its query field,
    and report.md counts the runs it reports."""
    with client_for(database_url) as client:
        runs = _dp_sweep(client)
        sweep_id, missing = runs[0]["sweep_id"], 10**9
        paths = ["report.md", "pivot.csv", "components.csv", "results.csv", "results.json",
                 f"compare/{sweep_id}"]  # fmt: skip
        for path in [*paths, f"../{sweep_id}/compare/{missing}"]:
            got = client.get(f"/api/v1/sweeps/{missing}/{path}")
            assert got.status_code == 404, path
            assert got.json()["detail"] == f"sweep {missing} not found", path
        bad = client.get(f"/api/v1/sweeps/{sweep_id}/pivot.csv", params={"rows": "no_such"})
        assert bad.status_code == 422, bad.text
        assert bad.json()["detail"][0]["loc"][:2] == ["query", "rows"], bad.text
        md = client.get(f"/api/v1/sweeps/{sweep_id}/report.md").text
        assert f"{len(runs)} runs: {len(runs)} succeeded" in md, md[:400]
