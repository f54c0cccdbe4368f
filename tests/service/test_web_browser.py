"""The dashboard in a real headless chromium against a live service holding finished sweeps:
every page loads without a console error and every chart is drawn. Saves a screenshot of the
sweep page to artifacts/ (and to docs/img/sweep.png when RINGLAB_UPDATE_SCREENSHOT=1).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _web_helpers import (
    Seeded,
    finish_run,
    live_server,
    make_web_app,
    seed_running_sweep,
    seed_sweeps,
)

from service.core.config import Settings

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
README_SHOT = ROOT / "docs" / "img" / "sweep.png"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="/usr/bin/chromium is missing: apt-get install -y chromium (the test command does)",
    ),
]


@pytest.fixture(scope="module")
def database_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('web') / 'ringlab.db'}"


@pytest.fixture(scope="module")
def service(database_file: str) -> Iterator[tuple[str, Seeded]]:
    seeded = seed_sweeps(database_file)
    with live_server(make_web_app(Settings(database_url=database_file))) as base:
        yield base, seeded


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A chromium page that records console errors, page errors and failed requests."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": 1500, "height": 1100})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on(
            "console",
            lambda m: (
                self.problems.append(f"console {m.type}: {m.text}")
                if m.type in ("error", "warning")
                else None
            ),
        )
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", self._on_failed)
        self.page.on("response", self._on_response)
        self.outside: list[str] = []
        self.page.on(
            "request",
            lambda r: None if r.url.startswith((base, "data:")) else self.outside.append(r.url),
        )

    def _on_failed(self, request: Any) -> None:
        # The page closes its event stream itself once the sweep has ended: that abort is normal.
        if request.url.endswith("/events") and request.failure == "net::ERR_ABORTED":
            return
        self.problems.append(f"request failed: {request.url} ({request.failure})")

    def _on_response(self, response: Any) -> None:
        if response.status >= 400:
            self.problems.append(f"HTTP {response.status}: {response.url}")

    def open(self, path: str, charts: int | None = None) -> Any:
        """The page at `path` once its network is idle (a 200); with `charts`, that many charts
        drawn on it (charts_drawn)."""
        response = self.page.goto(self.base + path, wait_until="networkidle")
        assert response is not None and response.status == 200, path
        if charts is not None:
            self.charts_drawn(charts)
        return self.page

    def charts_drawn(self, expected: int) -> None:
        """Every .chart div holds a drawn Plotly figure (its svg.main-svg)."""
        charts = self.page.locator("div.chart")
        assert charts.count() == expected
        for i in range(expected):
            chart = charts.nth(i)
            chart.locator("svg.main-svg").first.wait_for(state="attached", timeout=15_000)
            assert "js-plotly-plot" in (chart.get_attribute("class") or ""), chart
        self.check()

    def check(self) -> None:
        assert self.problems == [], self.problems
        assert self.outside == [], f"fetched from outside the service: {self.outside}"

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, service: tuple[str, Seeded]) -> Iterator[Page]:
    p = Page(browser, service[0])
    yield p
    p.close()


def test_sweeps_list(page: Page, service: tuple[str, Seeded]) -> None:
    seeded = service[1]
    pg = page.open("/")
    rows = pg.locator("#sweeps tbody tr")
    assert rows.count() == 3
    assert "max length per kernel" in rows.nth(0).inner_text()  # newest first
    assert pg.locator(".progress .bar").count() == 3
    text = pg.locator("#sweeps").inner_text()
    assert "succeeded 16 failed 1" in text  # counts by state of the rerun
    pg.locator(f'a[href="/sweeps/{seeded.benchmark}"]').first.click()
    pg.wait_for_load_state("networkidle")
    assert pg.url.endswith(f"/sweeps/{seeded.benchmark}")
    page.check()


def test_sweep_page_charts_table_and_screenshot(page: Page, service: tuple[str, Seeded]) -> None:
    seeded = service[1]
    # charts: throughput, memory, fraction of peak (no search, 2 world sizes)
    pg = page.open(f"/sweeps/{seeded.benchmark}", charts=3)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "sweep.png"
    pg.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("RINGLAB_UPDATE_SCREENSHOT") == "1":
        README_SHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, README_SHOT)
    # Throughput: one line per kernel x world size (dense W=1, dense W=2 data, ring, dilated).
    traces = pg.evaluate(
        "() => document.getElementById('chart-throughput').data.map(t => [t.name, t.x.length])"
    )
    points = dict(traces)
    assert points == {
        "dense · W=1 · batch_size=1": 4,
        "dense · W=2 · data-parallel · batch_size=2": 4,
        "dilated · dilation_rates=[1,2] · segment_lengths=[2048,4096] · W=1 · batch_size=1": 4,
        "ring · W=2 · sequence-parallel · batch_size=1": 5,
    }, traces
    assert not any("None" in name for name in points)
    # two world sizes: the scaling efficiency is a table, not a chart of two x values
    assert pg.locator("#chart-scaling").count() == 0
    scaling = {
        row.split("\t")[0]: row.split("\t")[1:]
        for row in pg.locator("#scaling-table tbody tr").all_inner_texts()
    }
    ring_name = "ring · sequence-parallel · batch_size=1 · seq 8,192"
    ring = scaling[ring_name + " (vs dense W=1)"]  # 0.85 / 1.03 (rank 1 lags), its interval
    assert ring == ["1.00", "0.83 (0.76-0.89)"], scaling
    data = scaling["dense · data-parallel · batch_size=2 · seq 8,192"]
    assert data == ["1.00", "0.94 (0.87-1.02)"], scaling  # weak scaling: 0.97 / 1.03
    names = pg.evaluate("() => document.getElementById('chart-memory').data.map(t => t.name)")
    assert "floor W=1" in names and "floor W=2" in names, names  # once each, short
    peak = pg.evaluate("() => document.getElementById('chart-peak').data.length")
    assert peak == 4
    # The table: 17 runs, sortable and filterable.
    body = pg.locator("#results tbody tr")
    assert body.count() == 17
    pg.fill("#filter", "ring ·")
    assert body.count() == 5
    assert pg.locator("#row-count").inner_text() == "5 of 17 runs"
    pg.locator('#results th[data-key="tokens_per_s"]').click()
    pg.locator('#results th[data-key="tokens_per_s"]').click()  # descending
    lengths = [c.split("\t")[2] for c in pg.locator("#results tbody tr").all_inner_texts()]
    assert lengths == ["2,048", "4,096", "8,192", "16,384", "32,768"]  # quadratic: tokens/s falls
    pg.fill("#filter", "")
    page.check()


def test_the_content_security_policy_admits_the_page_and_blocks_injected_script(
    page: Page, service: tuple[str, Seeded]
) -> None:
    """The sweep page draws every chart under its CSP (no violation reaches the console), and
    a script injected into it (what an XSS would add) does not run."""
    response = page.page.goto(
        f"{service[0]}/sweeps/{service[1].benchmark}", wait_until="networkidle"
    )
    assert response is not None and response.status == 200
    headers = response.headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"], headers
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    page.charts_drawn(3)
    ran = page.page.evaluate(
        """() => { const s = document.createElement("script");
                   s.textContent = "window.__injected = 1"; document.body.appendChild(s);
                   return window.__injected === 1; }"""
    )
    assert ran is False
    blocked = [p for p in page.problems if "Content Security Policy" in p]
    assert blocked and len(blocked) == len(page.problems), page.problems


def test_max_len_sweep_page_shows_probes(page: Page, service: tuple[str, Seeded]) -> None:
    pg = page.open(f"/sweeps/{service[1].maxlen}", charts=3)  # throughput, memory, maximum length
    traces = pg.evaluate(
        "() => document.getElementById('chart-maxlen').data.map(t => [t.name, t.x.length])"
    )
    assert dict(traces) == {"max length that fit": 4, "probe: fit": 9, "probe: oom": 6}, traces
    bars = pg.evaluate("() => document.getElementById('chart-maxlen').data[0].x")
    assert bars == [2048, 1536, 1536, 4096]  # block_sparse, dense, dense W=2 data, ring W=2
    assert pg.locator("#chart-peak").count() == 0  # CPU has no reference peak: no panel


def test_run_page(page: Page, service: tuple[str, Seeded]) -> None:
    seeded = service[1]
    pg = page.open(f"/runs/{seeded.ring_run}", charts=1)
    assert pg.locator("#ranks tbody tr").count() == 2
    env = pg.locator("#environment")
    assert "NVIDIA H100 80GB HBM3" in env.inner_text()
    threads = env.locator("tr", has=pg.locator("th", has_text="CPU threads per rank"))
    assert threads.locator("td").inner_text() == "16"
    assert '"kernel": "ring"' in pg.locator("#config").inner_text()
    pg = page.open(f"/runs/{seeded.failed_run}")
    assert "gloo timeout" in pg.locator("#error").inner_text()
    page.check()


def test_a_quote_in_a_run_error_stays_text(page: Page, service: tuple[str, Seeded]) -> None:
    """The failed run's error holds `" autofocus onfocus="window.__xss=1`: on the sweep page it
    is the error cell's whole tooltip and runs nothing (esc escapes quotes too)."""
    seeded = service[1]
    pg = page.open(f"/sweeps/{seeded.rerun}")
    pg.locator("#column-chooser summary").click()  # the error column is one of the chosen
    pg.locator('#column-options input[value="error"]').check()
    cell = pg.locator("#results span.err[title]").first
    cell.wait_for(state="attached", timeout=15_000)
    title = cell.get_attribute("title") or ""
    assert title.endswith('peer said " autofocus onfocus="window.__xss=1" x="'), title
    assert cell.get_attribute("onfocus") is None and cell.get_attribute("autofocus") is None
    pg.wait_for_timeout(300)  # an autofocus handler would have run by now
    assert pg.evaluate("window.__xss") is None
    page.check()


def test_compare_page(page: Page, service: tuple[str, Seeded]) -> None:
    seeded = service[1]
    pg = page.open(f"/compare?a={seeded.benchmark}&b={seeded.rerun}", charts=1)
    assert pg.locator("#pairs tbody tr").count() == 17
    # ring is 20% slower in the rerun at every length, and its 32K run failed there.
    regressions = pg.locator("#pairs tbody tr.regression")
    assert regressions.count() == 5
    assert "B failed" in regressions.last.inner_text()
    assert "slower" in regressions.first.inner_text()
    assert (
        "17 matching cells (0 only in A, 0 only in B); 5 regressions"
        in pg.locator("#verdict").inner_text()
    )


SUCCEEDED_ROWS = "n => document.querySelectorAll('#results tbody tr.row-succeeded').length === n"


def test_sweep_page_updates_live_from_events(page: Page, database_file: str) -> None:
    """The counts come with each event; the page then asks only for the runs an event named
    (dashboard.json?runs=...), never for the whole sweep again."""
    sweep_id, (first, second) = seed_running_sweep(database_file)
    pg = page.open(f"/sweeps/{sweep_id}")
    asked: list[str] = []
    pg.on("request", lambda r: asked.append(r.url) if "dashboard.json" in r.url else None)
    page.charts_drawn(0)  # nothing measured yet: no empty panels
    assert pg.locator("#live").inner_text() == "live"
    assert pg.locator("#progress span").inner_text() == "0/2"
    finish_run(database_file, first)
    pg.wait_for_function(
        "() => document.querySelector('#progress span').textContent === '1/2'", timeout=15_000
    )
    pg.wait_for_function(SUCCEEDED_ROWS, arg=1, timeout=15_000)
    # the panels its first run fills appear, live
    pg.wait_for_function("() => document.getElementById('chart-throughput')?.data", timeout=15_000)
    assert pg.evaluate("() => document.getElementById('chart-throughput').data.length") == 1
    finish_run(database_file, second)
    pg.wait_for_function(
        "() => document.getElementById('live').textContent === 'ended'", timeout=15_000
    )
    assert pg.locator("#progress span").inner_text() == "2/2"
    pg.wait_for_function(SUCCEEDED_ROWS, arg=2, timeout=15_000)
    assert asked and all(f"dashboard.json?runs={first}" in u or f"runs={second}" in u
                         for u in asked), asked  # fmt: skip
    page.check()


def test_a_large_sweep_loads_a_page_at_a_time(
    page: Page, service: tuple[str, Seeded], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above WHOLE_SWEEP_RUNS the page holds one page of rows, says how many of how many,
    loads the next on request, and draws no charts over a part of the sweep."""
    from service.web import router

    monkeypatch.setattr(router, "WHOLE_SWEEP_RUNS", 5)
    monkeypatch.setattr(router, "PAGE_RUNS", 8)
    seeded = service[1]
    pg = page.open(f"/sweeps/{seeded.benchmark}")
    total = int(pg.locator("#progress span").inner_text().split("/")[1])
    assert total > 16
    assert pg.locator("#results tbody tr").count() == 8
    assert pg.locator("#partial").inner_text() == f"8 of {total} runs loaded"
    assert "charts are drawn for sweeps of up to 5" in pg.locator("#no-charts").inner_text()
    assert pg.locator(".chart").count() == 0
    shown = 8
    while shown < total:
        pg.locator("#more").click()
        shown = min(total, shown + 8)
        pg.wait_for_function(
            "n => document.querySelectorAll('#results tbody tr').length === n", arg=shown
        )
    assert pg.locator("#more").is_hidden()
    assert pg.locator("#partial").inner_text() == f"{total} of {total} runs loaded"
    ids = pg.eval_on_selector_all(
        "#results tbody tr td:first-child", "cells => cells.map(c => c.textContent)"
    )
    assert len(set(ids)) == total  # each run once
    page.check()


def test_log_in_through_the_page_and_follow_a_sweep_live(browser: Any, tmp_path: Path) -> None:
    """With reads behind the token, chromium is sent to /login, logs in through the form, lands
    on the page it asked for, and the live sweep page's event stream and fetches work on the
    session cookie alone; logging out sends it back to the form."""
    from _api_helpers import TOKEN

    database = f"sqlite:///{tmp_path / 'ringlab.db'}"
    settings = Settings(database_url=database, api_token=TOKEN, require_token_for_reads=True)
    app = make_web_app(settings)
    with live_server(app) as base:
        sweep_id, (first, _second) = seed_running_sweep(database)
        page = Page(browser, base)
        try:
            pg = page.page
            pg.goto(f"{base}/sweeps/{sweep_id}", wait_until="networkidle")
            assert "/login?next=" in pg.url
            pg.fill("#token", "wrong")
            pg.click("button[type=submit]")
            assert "not this server's token" in pg.locator("#problem").inner_text()
            page.problems.clear()  # the 401 of the wrong token was the point
            pg.fill("#token", TOKEN)
            pg.click("button[type=submit]")
            pg.wait_for_load_state("networkidle")
            assert pg.url == f"{base}/sweeps/{sweep_id}"
            assert pg.locator("#live").inner_text() == "live"
            finish_run(database, first)
            pg.wait_for_function(SUCCEEDED_ROWS, arg=1, timeout=15_000)
            page.check()
            pg.click("#logout")
            pg.wait_for_load_state("networkidle")
            assert pg.url.endswith("/login")
            pg.goto(f"{base}/", wait_until="networkidle")
            assert "/login?next=" in pg.url
        finally:
            page.close()


def test_the_header_says_why_queued_runs_wait(browser: Any, tmp_path: Path) -> None:
    """While the embedded scheduler cannot reach Ray, every page's header shows why, and a
    queued run's page says it beside the run: seen in chromium under the pages' CSP. (The link
    state is set here; test_ray_unreachable reaches it from a real refused connection.)"""
    import threading
    import time

    from service.ray_status import RAY, Link

    database = f"sqlite:///{tmp_path / 'ringlab.db'}"
    app = make_web_app(Settings(database_url=database))
    stop = threading.Event()
    with live_server(app) as base:
        sweep_id, (_first, second) = seed_running_sweep(database)  # second is queued
        scheduler = threading.Thread(target=stop.wait, daemon=True)  # an embedded one, alive
        scheduler.start()
        app.state.scheduler_thread = scheduler
        now, before = time.time(), RAY.get()
        RAY.set(Link("unreachable", "10.0.0.9:6379", 3, now, "ConnectionError: refused", now + 4))
        page = Page(browser, base)
        try:
            why = (
                "queued: the scheduler cannot reach Ray at 10.0.0.9:6379: ConnectionError: refused"
            )
            for path in ("/", f"/sweeps/{sweep_id}", f"/runs/{second}"):
                banner = page.open(path).locator("header.top #cluster-problem")
                assert banner.is_visible() and banner.inner_text() == why, path
            assert page.page.locator("#waiting").inner_text() == why
            page.check()
        finally:
            page.close()
            RAY.set(before)
            stop.set()
            app.state.scheduler_thread = None


def test_the_schemes_chart_draws_tokens_per_s_against_length_per_scheme(
    browser: Any, tmp_path: Path
) -> None:
    """A sweep of three sequence-parallel schemes at W=4 beside dense at W=1, stored through
    the scheduler's write path: the sweep page draws one line per scheme, each point the
    slowest rank's tokens/s recomputed here from the ranks' raw medians, with both axis titles
    naming their unit. (Without dense the chart would be the throughput chart again: not drawn.)"""
    from test_result_goldens import CPU, _rank, _store

    from workers.config import RunConfig

    database = f"sqlite:///{tmp_path / 'ringlab.db'}"
    spec = {
        "name": "schemes",
        "base": {**CPU, "causal": True},
        "grid": {"seq_len": [1024, 2048]},
        "zip": {"kernel": ["ring", "ulysses", "allgather_kv", "dense"], "world_size": [4, 4, 4, 1]},
    }
    with api_client(database) as client:
        sweep_id = _store(client, spec)
        runs = client.get("/api/v1/runs", params={"sweep_id": sweep_id}).json()["data"]
    expected: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        config = RunConfig.model_validate(run["config"])
        if config.kernel == "dense":
            continue
        slowest = max(_rank(config, r, config.seq_len).median_s for r in range(4))
        point = (config.seq_len, config.batch_size * config.seq_len / slowest)
        expected.setdefault(config.kernel, []).append(point)
    app = make_web_app(Settings(database_url=database))
    with live_server(app) as base:
        page = Page(browser, base)
        try:
            pg = page.open(f"/sweeps/{sweep_id}")
            chart = pg.locator("#chart-sp-schemes")
            chart.locator("svg.main-svg").first.wait_for(state="attached", timeout=15_000)
            drawn = pg.evaluate(
                "() => { const c = document.getElementById('chart-sp-schemes');"
                " return {lines: c.data.map(t => [t.name, t.x, t.y]),"
                " x: c.layout.xaxis.title.text, y: c.layout.yaxis.title.text}; }"
            )
            lines = {name: list(zip(x, y, strict=True)) for name, x, y in drawn["lines"]}
            assert set(lines) == set(expected), lines
            for name, points in expected.items():
                got = lines[name]
                assert [x for x, _ in got] == sorted(x for x, _ in points), name
                for (x, y), (want_x, want_y) in zip(got, sorted(points), strict=True):
                    assert x == want_x and y == pytest.approx(want_y, rel=1e-9), (name, x)
            assert drawn["x"] == "sequence length (tokens)"
            assert drawn["y"] == "throughput (tokens/s)"
            titles = pg.locator("#chart-sp-schemes .legendtext").all_text_contents()
            assert sorted(titles) == sorted(expected), titles
            page.check()
        finally:
            page.close()


def test_the_demo_page_reads_as_drawn(browser: Any, tmp_path: Path) -> None:
    """The demo's sweep in chromium: each drawn series its own colour, the same in every
    chart; the F/B crossover line drawn clear of the y-axis (pixels from plotly's own axes);
    no chart twice; and the results table's legend says what its interval covers and what
    "within noise" (`~` in the terminal) means."""
    from test_chart_reading import DEMO
    from test_result_goldens import _store

    database = f"sqlite:///{tmp_path / 'ringlab.db'}"
    with api_client(database) as client:
        sweep_id = _store(client, DEMO)
    with live_server(make_web_app(Settings(database_url=database))) as base:
        page = Page(browser, base)
        try:
            pg = page.open(f"/sweeps/{sweep_id}", charts=3)
            drawn = pg.evaluate(
                """() => [...document.querySelectorAll('div.chart')].map((c) => ({
                  id: c.id,
                  lines: c._fullData.filter((t) => t.mode === 'lines+markers')
                    .map((t) => [t.name, t.line.color]),
                  cross: c._fullData.filter((t) => (t.name || '').startsWith('F/B crossover'))
                    .map((t) => c._fullLayout.xaxis.l2p(Math.log10(t.x[0]))),
                }))"""
            )
            seen: dict[str, str] = {}
            for chart in drawn:
                colours = dict(chart["lines"])
                assert len(set(colours.values())) == len(colours), chart
                for name, colour in colours.items():
                    assert seen.setdefault(name, colour) == colour, (chart["id"], name)
            (comm,) = [c for c in drawn if c["id"] == "chart-comm"]
            (x,) = comm["cross"]
            assert x > 20, comm  # pixels right of the y-axis (0 is on it)
            assert [c["id"] for c in drawn] == ["chart-throughput", "chart-memory", "chart-comm"]
            legend = pg.locator("#results-legend").inner_text()
            assert "covering 75%" in legend and "within noise" in legend and "~" in legend
            page.check()
        finally:
            page.close()
