"""The sweep page's charts as a researcher reads them: one colour per series in a chart and the
same colour for a series (and its kernel) in every chart of the sweep, no chart that draws the
same points as another, and an F/B crossover line that stands clear of the y-axis.

Sweeps are stored through the API and the scheduler's write path with the goldens' outcomes
(tests/service/test_result_goldens.py: ring runs carry steps, so their crossover), and the
figures read from the page's own data (/sweeps/{id}/dashboard.json).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from _api_helpers import api_client
from test_result_goldens import CPU, _store
from test_web import _row

from service.results import charts

DEMO = {
    "name": "cpu-quick",
    "base": {**CPU, "batch_size": 2, "iterations": 3},
    "grid": {"seq_len": [512, 1024, 2048]},
    "zip": {"kernel": ["dense", "dense", "ring"], "world_size": [1, 2, 2],
            "parallel": ["sequence", "data", "sequence"]},
}  # fmt: skip


def _figures(tmp_path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    with api_client(f"sqlite:///{tmp_path / 'charts.db'}") as client:
        sweep_id = _store(client, spec)
        return client.get(f"/sweeps/{sweep_id}/dashboard.json").json()["figures"]


def _series(figure: dict[str, Any]) -> dict[str, str]:
    """name -> colour of a figure's measured lines (not floors nor crossover lines)."""
    return {
        t["name"]: t["line"]["color"]
        for t in figure["data"]
        if t.get("mode") == "lines+markers" and "line" in t
    }


def test_the_demo_colours_each_series_apart_and_alike_in_every_chart(tmp_path: Path) -> None:
    figures = _figures(tmp_path, DEMO)
    assert {"chart-throughput", "chart-memory", "chart-comm"} <= set(figures), list(figures)
    seen: dict[str, str] = {}
    for chart_id, figure in figures.items():
        colours = _series(figure)
        assert len(set(colours.values())) == len(colours), (chart_id, colours)
        for name, colour in colours.items():
            assert seen.setdefault(name, colour) == colour, (chart_id, name, seen)
    assert len(_series(figures["chart-throughput"])) == 3
    assert (
        _series(figures["chart-comm"])["ring · W=2 · sequence-parallel"]
        == (_series(figures["chart-throughput"])["ring · W=2 · sequence-parallel"])
    )


def test_the_crossover_line_stands_clear_of_the_y_axis(tmp_path: Path) -> None:
    comm = _figures(tmp_path, DEMO)["chart-comm"]
    (line,) = [t for t in comm["data"] if t["name"].startswith("F/B crossover")]
    lo, hi = comm["layout"]["xaxis"]["range"]
    at = math.log10(line["x"][0])
    assert lo + 0.05 * (hi - lo) < at < hi - 0.05 * (hi - lo), (lo, at, hi)
    # a crossover below every measured length: still inside, a tenth of a decade off the axis
    rows = [
        _row(i, kernel="ring", world_size=2, seq_len=n) for i, n in enumerate((1024, 2048, 4096))
    ]
    for r in rows:
        r.label = r.series = "ring"
        r.exposed_comm_share = 0.05
        r.crossover_tokens = 40 if r.seq_len == 1024 else None
        r.crossover_basis = "step compute rate"
    figure = charts.exposed_comm_figure(rows)
    lo, _ = figure["layout"]["xaxis"]["range"]
    assert lo <= math.log10(40) - 0.1, lo


def test_a_schemes_chart_is_drawn_only_when_it_is_not_the_throughput_chart(
    tmp_path: Path,
) -> None:
    schemes = {"name": "schemes", "base": {**CPU, "world_size": 2},
               "grid": {"seq_len": [1024, 2048], "kernel": ["ring", "ulysses"]}}  # fmt: skip
    only = _figures(tmp_path / "a", schemes)
    assert "chart-throughput" in only and "chart-sp-schemes" not in only, list(only)
    mixed = {
        "name": "schemes and dense",
        "base": CPU,
        "grid": {"seq_len": [1024, 2048]},
        "zip": {"kernel": ["dense", "ring", "ulysses"], "world_size": [1, 2, 2]},
    }
    both = _figures(tmp_path / "b", mixed)
    throughput, sp = _series(both["chart-throughput"]), _series(both["chart-sp-schemes"])
    assert sorted(sp) == ["ring", "ulysses"], sp
    for kernel, colour in sp.items():  # a kernel keeps its colour from chart to chart
        (name,) = [n for n in throughput if n.startswith(kernel)]
        assert throughput[name] == colour, (kernel, throughput, sp)
