"""One cell across sweeps (service.history): GET /api/v1/cells/history and the /cells/history
page, on three stored sweeps of the same cell run by three commits (plus one other cell that
must not show); the page in a real headless chromium shows the three runs in the order they
ran with their code versions, and its chart is drawn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from _api_helpers import store_result
from _web_helpers import T0, live_server, make_web_app
from test_web_browser import CHROMIUM, CHROMIUM_ARGS, Page

from service.core.config import Settings
from service.db.engine import make_engine, make_sessionmaker
from service.db.models import Environment, Run

pytestmark = pytest.mark.timeout(180)
API = "/api/v1"
SHAS = ("1111111aaaa", "2222222bbbb", "3333333cccc")
MEDIANS = (0.010, 0.012, 0.009)
BASE = {"kernel": "dense", "num_heads": 2, "head_dim": 16, "device": "cpu", "iterations": 3}


def _spec(name: str, lengths: list[int]) -> dict[str, Any]:
    return {"name": name, "base": BASE, "grid": {"seq_len": lengths}}


def _seed(base: str, url: str) -> list[int]:
    """Three sweeps of seq 128 (the third also runs 256), finished in order by three commits
    (the second dirty, with a plugin from a checkout); the run ids of the seq-128 cell."""
    engine = make_engine(url)
    sm = make_sessionmaker(engine)
    cell_runs = []
    for i, sha in enumerate(SHAS):
        lengths = [128, 256] if i == 2 else [128]
        sweep = httpx.post(f"{base}{API}/sweeps", json=_spec(f"commit {i}", lengths)).json()
        runs = httpx.get(f"{base}{API}/runs", params={"sweep_id": sweep["id"]}).json()["data"]
        with sm() as session:
            code = {"ext-kernels": {"git_sha": "feed" + sha, "git_dirty": True}} if i else {}
            env = Environment(hash=f"{i}" * 64, hosts=["node-a"], gpus=[], torch="2.13.0",
                              python="3.11", git_sha=sha, git_dirty=i == 1,
                              plugin_code=code)  # fmt: skip
            session.add(env)
            session.commit()
            for r in runs:
                store_result(session, r["id"], medians=(MEDIANS[i],), peak=(i + 1) << 20)
                run = session.get(Run, r["id"])
                assert run is not None
                run.environment_id = env.id
                run.finished_at = T0 + timedelta(days=i)
                session.commit()
                if r["seq_len"] == 128:
                    cell_runs.append(r["id"])
    engine.dispose()
    return cell_runs


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[int]]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('history') / 'ringlab.db'}"
    with live_server(make_web_app(Settings(database_url=url))) as base:
        yield base, _seed(base, url)


def test_the_api_lists_the_cell_in_every_sweep_oldest_first(
    service: tuple[str, list[int]],
) -> None:
    base, runs = service
    answer = httpx.get(f"{base}{API}/cells/history", params={"run": runs[-1]}).json()
    entries = answer["entries"]
    assert [e["run_id"] for e in entries] == runs  # the 256 cell is another cell
    assert [e["git_sha"] for e in entries] == list(SHAS)
    assert [e["git_dirty"] for e in entries] == [False, True, False]
    assert [e["median_s"] for e in entries] == pytest.approx(MEDIANS)
    assert [e["peak_memory_bytes"] for e in entries] == [1 << 20, 2 << 20, 3 << 20]
    assert entries[1]["plugin_code"]["ext-kernels"]["git_sha"] == "feed" + SHAS[1]
    assert answer["cell"]["seq_len"] == 128 and "name" not in answer["cell"]
    by_cell = httpx.get(
        f"{base}{API}/cells/history", params={"cell": json.dumps({**BASE, "seq_len": 128})}
    ).json()
    assert [e["run_id"] for e in by_cell["entries"]] == runs  # iterations do not matter


@pytest.mark.parametrize(
    ("params", "field", "needle"),
    [
        ({}, "run", "exactly one of run"),
        ({"run": 1, "cell": "{}"}, "run", "exactly one of run"),
        ({"cell": "{kernel"}, "cell", "not JSON"),
        ({"cell": "[1]"}, "cell", "a JSON object"),
        ({"cell": json.dumps({**BASE, "seq_len": 0})}, "cell", "seq_len"),
    ],
)
def test_a_bad_cell_is_a_422_naming_the_parameter(
    service: tuple[str, list[int]], params: dict[str, Any], field: str, needle: str
) -> None:
    r = httpx.get(f"{service[0]}{API}/cells/history", params=params)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["query", field] and needle in error["msg"], error
    assert httpx.get(f"{service[0]}{API}/cells/history?run=999").status_code == 404


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is missing")
def test_the_history_page_shows_the_cell_across_three_sweeps_with_their_code(
    service: tuple[str, list[int]],
) -> None:
    from playwright.sync_api import sync_playwright

    base, runs = service
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = Page(browser, base)
        try:
            run_page = page.open(f"/runs/{runs[0]}")
            run_page.click("#cell-history")
            run_page.wait_for_selector("#history")
            assert run_page.url == f"{base}/cells/history?run={runs[0]}"
            rows = run_page.locator("#history tbody tr")
            assert rows.count() == 3
            texts = [rows.nth(i).inner_text() for i in range(3)]
            for i, (text, sha) in enumerate(zip(texts, SHAS, strict=True)):
                assert f"commit {i}" in text and sha in text, text
                assert f"2026-11-0{i + 1}" in text, text
            assert "(dirty)" in texts[1] and "ext-kernels feed" + SHAS[1] in texts[1]
            assert "(dirty)" not in texts[0] and "12 ms" in texts[1]
            assert "seq 128" in run_page.locator("#cell").inner_text()
            page.charts_drawn(1)
        finally:
            page.close()
            browser.close()


def test_the_history_query_on_each_database(database_url: str) -> None:
    """The same cell in two sweeps, another cell beside it: SQLite and Postgres agree."""
    from _api_helpers import api_client

    with api_client(database_url) as client:
        runs = []
        for name in ("one", "two"):
            sweep = client.post(f"{API}/sweeps", json=_spec(name, [128, 256])).json()
            listed = client.get(f"{API}/runs", params={"sweep_id": sweep["id"]}).json()["data"]
            runs.append(next(r["id"] for r in listed if r["seq_len"] == 128))
            with client.app.state.sessionmaker() as session:
                for r in listed:
                    store_result(session, r["id"], medians=(0.01,))
        answer = client.get(f"{API}/cells/history", params={"run": runs[1]}).json()
        assert [e["run_id"] for e in answer["entries"]] == runs
        assert all(e["git_sha"] == "abc1234" for e in answer["entries"])


def test_out_of_range_numbers_in_a_cell_are_a_422_on_each_database(database_url: str) -> None:
    """A seq_len no BIGINT holds once reached the database (a 500 on both); the API and the page
    now answer 422 naming `cell` and the key, whatever the number's size or sign."""
    from _api_helpers import api_client

    with api_client(database_url) as client:
        client.post(f"{API}/sweeps", json=_spec("one", [128]))
        for seq_len in (10**26, 2**63, 99999999999999999999999999):
            cell = json.dumps({"kernel": "dense", "seq_len": seq_len})
            for path in (f"{API}/cells/history", "/cells/history"):
                r = client.get(path, params={"cell": cell})
                assert r.status_code == 422, (path, r.status_code, r.text)
                (error,) = r.json()["detail"]
                assert error["loc"] == ["query", "cell"], error
                assert error["msg"].startswith("seq_len: at most 9,223,372,036,854,775,807"), error
        other = json.dumps({**BASE, "seq_len": 128, "batch_size": -(10**30)})
        r = client.get(f"{API}/cells/history", params={"cell": other})
        assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("batch_size: ")
