"""What a researcher reads on each page (issue 40), in a real headless chromium at 1,400 px:
no horizontal scrollbar, every axis title names its unit, no two legend entries alike, no
panel without data, no tick label overlapping another. Each page's screenshot goes to
artifacts/reader-<page>.png (the README's docs/img/sweep.png comes from test_web_browser).
Also: a missing sweep or run is an HTML page with a link back (the API stays JSON), and a
typo'd kernel gets "did you mean"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _web_helpers import Seeded, live_server, make_web_app, seed_sweeps
from fastapi.testclient import TestClient
from test_report_tables import _dp_sweep
from test_web_browser import ARTIFACTS, CHROMIUM_ARGS, ROOT, browser, pytestmark  # noqa: F401

from service.core.config import Settings

WIDTH = 1400

READ = """() => {
  const out = {scroll: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
               charts: []};
  const overlaps = (rects) => {
    for (let i = 0; i < rects.length; i++) for (let j = i + 1; j < rects.length; j++) {
      const a = rects[i], b = rects[j];
      if (a.width && b.width && a.left < b.right - 1 && b.left < a.right - 1
          && a.top < b.bottom - 1 && b.top < a.bottom - 1) return true;
    }
    return false;
  };
  for (const div of document.querySelectorAll("div.chart")) {
    const layout = div.layout || {};  // the figure's own titles (not plotly's placeholders)
    const titles = Object.keys(layout).filter((k) => /^[xy]axis\\d*$/.test(k))
      .filter((k) => layout[k].visible !== false)
      .map((k) => (layout[k].title && layout[k].title.text) || "");
    const legend = (div.data || []).filter((t) => t.showlegend !== false && t.name)
      .map((t) => t.name);
    const points = (div.data || []).reduce((n, t) => n + ((t.x || t.y || []).length), 0);
    const ticks = ["xtick", "ytick"].map((cls) =>
      overlaps([...div.querySelectorAll(`g.${cls} text`)].map((t) => t.getBoundingClientRect())));
    out.charts.push({id: div.id, titles, legend, points, tickOverlap: ticks.some(Boolean)});
  }
  return out;
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Seeded, int]]:
    """A live service with the seeded sweeps and the dp-vs-ring CPU sweep of the issue."""
    url = f"sqlite:///{tmp_path_factory.mktemp('reader') / 'ringlab.db'}"
    seeded = seed_sweeps(url)
    app = make_web_app(Settings(database_url=url))
    with TestClient(app, base_url="http://localhost") as client:
        dp = _dp_sweep(client)[0]["sweep_id"]
    with live_server(make_web_app(Settings(database_url=url))) as base:
        yield base, seeded, dp


def pages(seeded: Seeded, dp: int) -> dict[str, str]:
    return {
        "sweeps": "/",
        "sweep": f"/sweeps/{seeded.benchmark}",
        "sweep-maxlen": f"/sweeps/{seeded.maxlen}",
        "sweep-dp-vs-ring": f"/sweeps/{dp}",
        "run": f"/runs/{seeded.ring_run}",
        "compare": f"/compare?a={seeded.benchmark}&b={seeded.rerun}",
    }


def _problems(name: str, seen: dict[str, Any]) -> list[str]:
    """What a reader would trip over on one page, one sentence each."""
    found = []
    width, client = seen["scroll"]
    if width > client:
        found.append(f"{name}: {width} px wide in a {client} px window (horizontal scrollbar)")
    for c in seen["charts"]:
        where = f"{name} #{c['id']}"
        found += [f"{where}: axis title {t!r} has no (unit)" for t in c["titles"]
                  if t and not t.rstrip().endswith(")")]  # fmt: skip
        doubled = sorted({n for n in c["legend"] if c["legend"].count(n) > 1})
        found += [f"{where}: legend entry {n!r} twice" for n in doubled]
        if not c["points"]:
            found.append(f"{where}: an empty panel")
        if c["tickOverlap"]:
            found.append(f"{where}: tick labels overlap")
    return found


def test_every_page_reads_cleanly_at_1400_px(browser: Any, site: tuple[str, Seeded, int]) -> None:  # noqa: F811
    base, seeded, dp = site
    context = browser.new_context(viewport={"width": WIDTH, "height": 1000})
    problems: list[str] = []
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        ARTIFACTS.mkdir(exist_ok=True)
        for name, path in pages(seeded, dp).items():
            response = page.goto(base + path, wait_until="networkidle")
            assert response is not None and response.status == 200, path
            for chart in page.locator("div.chart").all():
                chart.locator("svg.main-svg").first.wait_for(state="attached", timeout=15_000)
            page.wait_for_timeout(300)  # plotly's last relayout
            problems += _problems(name, page.evaluate(READ))
            shot = ARTIFACTS / f"reader-{name}.png"
            page.screenshot(path=str(shot), full_page=True)
        assert errors == []
    finally:
        context.close()
    assert problems == [], "\n".join(problems)


def test_the_results_table_keeps_its_chosen_columns_and_sorts(
    browser: Any,  # noqa: F811
    site: tuple[str, Seeded, int],
) -> None:
    base, seeded, _ = site
    context = browser.new_context(viewport={"width": WIDTH, "height": 1000})
    try:
        page = context.new_page()
        page.goto(f"{base}/sweeps/{seeded.benchmark}", wait_until="networkidle")
        heads = page.locator("#results thead th").all_inner_texts()
        assert [h.rstrip(" ▲▼") for h in heads] == [
            "run", "configuration", "length", "W", "status", "time (median interval)",
            "tokens/s", "peak mem per rank", "speedup",
        ]  # fmt: skip
        page.locator("#column-chooser summary").click()
        page.locator('#column-options input[value="efficiency"]').check()
        assert "efficiency" in page.locator("#results thead").inner_text()
        page.locator('#results th[data-key="efficiency"]').click()  # sorting stays
        assert page.locator('#results th[data-key="efficiency"]').get_attribute("aria-sort") == (
            "ascending"
        )
        page.fill("#filter", "ring ·")  # and filtering
        assert page.locator("#row-count").inner_text() == "5 of 17 runs"
    finally:
        context.close()


def test_a_missing_sweep_or_run_is_a_page_with_a_way_back(
    browser: Any,  # noqa: F811
    site: tuple[str, Seeded, int],
) -> None:
    base = site[0]
    context = browser.new_context(viewport={"width": WIDTH, "height": 800})
    try:
        page = context.new_page()
        for path, what in (("/sweeps/9999", "No sweep 9999"), ("/runs/9999", "No run 9999")):
            response = page.goto(base + path)
            assert response is not None and response.status == 404
            assert response.headers["content-type"].startswith("text/html")
            assert page.locator("#not-found").inner_text().startswith(what)
            assert page.locator("a#back").get_attribute("href") == "/"
    finally:
        context.close()
    api = httpx.get(f"{base}/api/v1/sweeps/9999")  # the API answers JSON as before
    assert api.status_code == 404 and api.json() == {"detail": "sweep 9999 not found"}


def test_a_typoed_kernel_gets_did_you_mean(site: tuple[str, Seeded, int]) -> None:
    spec = {"name": "typo", "base": {"kernel": "ring_dilatd", "device": "cpu"},
            "grid": {"seq_len": [128]}}  # fmt: skip
    answer = httpx.post(f"{site[0]}/api/v1/sweeps", json=spec)
    assert answer.status_code == 422
    (error,) = answer.json()["detail"]
    assert "did you mean 'ring_dilated'?" in error["msg"], error


def test_chart_conventions_on_rows() -> None:
    """Series in numeric order, one colour per series in a chart and the same one in every
    chart, floors once each."""
    from test_web import _row

    from service.results import charts

    assert sorted(["seq 1,024", "seq 512", "seq 2,048"], key=charts.natural_key) == [
        "seq 512", "seq 1,024", "seq 2,048",
    ]  # fmt: skip
    assert [charts.tokens_text(n) for n in (1024, 1536, 32768, 1 << 20, 1000)] == [
        "1K", "1.5K", "32K", "1M", "1,000",
    ]  # fmt: skip
    rows = []
    for i, (kernel, w, parallel) in enumerate(
        [("dense", 1, "sequence"), ("dense", 2, "data"), ("ring", 2, "sequence")]
    ):
        for j, n in enumerate((512, 1024, 2048)):
            row = _row(10 * i + j, 0.01 * n / 512, kernel=kernel, world_size=w,
                       parallel=parallel, seq_len=n)  # fmt: skip
            row.label = f"{kernel} · W={w} · {parallel}"
            rows.append(row)
    styles = charts.Styles(rows)
    throughput = charts.throughput_figure(rows, styles)["data"]
    memory = charts.memory_figure(rows, styles)["data"]
    colours = {t["name"]: t["line"]["color"] for t in throughput}
    assert colours == {t["name"]: t["line"]["color"] for t in memory if t["name"] in colours}
    assert len(set(colours.values())) == len(colours) == 3, colours  # dense W=1 / W=2 apart
    assert colours["dense · W=1 · sequence"] != colours["ring · W=2 · sequence"]
    floors = [t["name"] for t in memory if "floor" in t["name"]]
    assert len(floors) == len(set(floors)) and all(len(n) <= 20 for n in floors), floors
