"""The sweep page's chart of packed documents in a real headless chromium: each scheme and
balance's bar per length, its height the slowest rank's median recomputed from the ranks' raw
times, its hover saying the kept-pairs and measured imbalance and % of ideal recomputed from the
ranks (the W=1 run's time over W), the fastest of each length outlined; the legend and category
labels as drawn, and the page read as test_web_reader reads every page (axis titles with units,
no tick labels overlapping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _documents_helpers import API, CELLS, SPEC, recomputed, store_documents_sweep
from _web_helpers import live_server, make_web_app
from test_web_browser import CHROMIUM, Page, browser  # noqa: F401 (the browser fixture)
from test_web_reader import READ, WIDTH, _problems

from service.core.config import Settings

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is missing"),
]

DRAWN = """() => {
  const c = document.getElementById('chart-documents');
  return {
    bars: c.data.map((t) => ({name: t.name, x: t.x, y: t.y, run: t.customdata,
                              outline: t.marker.line.width})),
    legend: [...c.querySelectorAll('.legendtext')].map((e) => e.textContent),
    categories: [...c.querySelectorAll('g.xtick text')].map((e) => e.textContent),
    title: c.layout.yaxis.title.text,
  };
}"""


def _hover(pg: Any, curve: int, point: int, run_id: int) -> str:
    """The hover label plotly draws over bar `point` of trace `curve` (the run's: each label
    ends with its run)."""
    pg.evaluate(
        "([curve, point]) => { const c = document.getElementById('chart-documents');"
        " Plotly.Fx.unhover(c); Plotly.Fx.hover(c, [{curveNumber: curve, pointNumber: point}]); }",
        [curve, point],
    )
    found = pg.wait_for_function(
        "(run) => [...document.querySelectorAll('#chart-documents .hoverlayer .hovertext')]"
        ".map((g) => [...g.querySelectorAll('text')].map((t) => t.textContent).join(' '))"
        ".find((t) => t.endsWith('run ' + run))",
        arg=run_id,
        timeout=5_000,
    )
    return str(found.json_value())


def _text(config: dict[str, Any]) -> str:
    balance = config["params"].get("balance")
    return config["kernel"] if balance is None else f"{config['kernel']} · {balance}"


def test_the_documents_chart_reads_as_the_ranks_measured(browser: Any, tmp_path: Path) -> None:  # noqa: F811
    database = f"sqlite:///{tmp_path / 'ringlab.db'}"
    with api_client(database) as client:
        sweep_id = store_documents_sweep(client)
        listed = client.get(f"{API}/runs", params={"sweep_id": sweep_id}).json()["data"]
        runs = {r["id"]: client.get(f"{API}/runs/{r['id']}").json() for r in listed}
    single = {r["config"]["seq_len"]: r for r in runs.values() if r["config"]["world_size"] == 1}
    with live_server(make_web_app(Settings(database_url=database))) as base:
        page = Page(browser, base)
        page.page.set_viewport_size({"width": WIDTH, "height": 1000})
        try:
            pg = page.open(f"/sweeps/{sweep_id}")
            for chart in pg.locator("div.chart").all():
                chart.locator("svg.main-svg").first.wait_for(state="attached", timeout=15_000)
            pg.wait_for_timeout(300)  # plotly's last relayout
            assert _problems("documents", pg.evaluate(READ)) == []
            drawn = pg.evaluate(DRAWN)
            lengths = SPEC["grid"]["seq_len"]
            names = [f"{n:,} tokens · W=2" for n in lengths]
            assert [b["name"] for b in drawn["bars"]] == names
            assert sorted(drawn["legend"]) == sorted(names), drawn["legend"]
            schemes = sorted({_text(r["config"]) for r in runs.values()
                              if r["config"]["world_size"] == 2})  # fmt: skip
            assert len(schemes) == len([c for c in CELLS if c[2] == 2])
            assert sorted(drawn["categories"]) == schemes, drawn["categories"]
            assert drawn["title"] == "time per iteration (ms)"
            for curve, bars in enumerate(drawn["bars"]):
                slowest = {run_id: max(r["median_s"] for r in runs[run_id]["rank_results"])
                           for run_id in bars["run"]}  # fmt: skip
                fastest = min(slowest, key=slowest.__getitem__)
                assert [w > 0 for w in bars["outline"]] == [r == fastest for r in bars["run"]]
                for point, (x, y, run_id) in enumerate(
                    zip(bars["x"], bars["y"], bars["run"], strict=True)
                ):
                    run = runs[run_id]
                    config, ranks = run["config"], run["rank_results"]
                    want = recomputed(ranks, config)
                    assert x == _text(config)
                    assert y == pytest.approx(want["median_s"] * 1e3, rel=1e-9), x
                    one = max(r["median_s"] for r in single[config["seq_len"]]["rank_results"])
                    kept, waste = want["kept_pairs_imbalance"], want["wasted_comm_share"]
                    label = _hover(pg, curve, point, run_id)
                    expect = (
                        f"kept {'-' if kept is None else f'{kept:.3f}'} · measured "
                        f"{want['compute_imbalance']:.3f} · wasted comm "
                        f"{'-' if waste is None else f'{waste:.1%}'} · "
                        f"{one / config['world_size'] / want['median_s']:.1%} of ideal"
                    )
                    assert expect in label, (label, expect)
                    assert ("fastest" in label) == (run_id == fastest), label
            ring = min(i for i, r in runs.items() if r["config"]["kernel"] == "ring")
            pg = page.open(f"/runs/{ring}")  # its kept-pairs column and share line fit too
            for chart in pg.locator("div.chart").all():
                chart.locator("svg.main-svg").first.wait_for(state="attached", timeout=15_000)
            assert pg.locator("#work-share").is_visible()
            assert _problems("documents run", pg.evaluate(READ)) == []
            page.check()
        finally:
            page.close()
