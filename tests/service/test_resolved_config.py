"""Every resolved setting is recorded: a run's stored config holds the layout, plan and inner
kernel params that run, not null and "auto"; the API record, the results CSV and report.md say
the same, and the label names the layout where it varies within the sweep."""

from __future__ import annotations

import csv
import html
import io
import json
import re
from collections.abc import Iterator

import httpx
import pytest
from _web_helpers import live_server, make_web_app

from service.core.config import Settings
from service.db.migrate import upgrade
from service.results.baselines import _match_key
from service.spec import SweepSpec, expand
from workers import resolved

RING = {"kernel": "ring", "world_size": 2, "device": "cpu", "seq_len": 512, "num_heads": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('resolved') / 'ringlab.db'}"
    upgrade(url)
    with live_server(make_web_app(Settings(database_url=url))) as served:
        yield served


def test_a_causal_rings_default_layout_is_stored_as_zigzag_and_labelled(base: str) -> None:
    spec = {"name": "layouts", "base": RING, "grid": {"causal": [True, False]}}
    sweep = httpx.post(f"{base}/api/v1/sweeps", json=spec).json()["id"]
    runs = httpx.get(f"{base}/api/v1/runs", params={"sweep_id": sweep, "sort": "id"}).json()
    layouts = {r["causal"]: r["config"]["params"]["layout"] for r in runs["data"]}
    assert layouts == {True: "zigzag", False: "contiguous"}
    one = httpx.get(f"{base}/api/v1/runs/{runs['data'][0]['id']}").json()
    assert one["config"]["params"]["layout"] == "zigzag"
    rows = httpx.get(f"{base}/api/v1/sweeps/{sweep}/results.json").json()
    labels = {r["causal"]: r["label"] for r in rows}
    assert "layout=zigzag" in labels[True] and "layout=contiguous" in labels[False]
    table = csv.DictReader(io.StringIO(httpx.get(f"{base}/api/v1/sweeps/{sweep}/results.csv").text))
    assert {json.loads(r["params"])["layout"] for r in table} == {"zigzag", "contiguous"}
    report = httpx.get(f"{base}/api/v1/sweeps/{sweep}/report.md").text
    assert labels[True] in report and labels[False] in report


def test_a_zigzag_rings_run_page_shows_its_stored_layout(base: str) -> None:
    """The run page, rendered by the app: its stored config (the page's config block) says
    zigzag, and its heading's label names the layout, which varies within the sweep."""
    spec = {"name": "page", "base": {**RING, "causal": True},
            "grid": {"params.layout": [None, "contiguous"]}}  # fmt: skip
    sweep = httpx.post(f"{base}/api/v1/sweeps", json=spec).json()["id"]
    runs = httpx.get(f"{base}/api/v1/runs", params={"sweep_id": sweep, "sort": "id"}).json()
    first = runs["data"][0]["id"]  # asked for with layout null: a causal ring's zigzag
    page = httpx.get(f"{base}/runs/{first}").text
    shown = re.search(r'<pre id="config">(.*?)</pre>', page, re.S)
    assert shown is not None
    assert json.loads(html.unescape(shown.group(1)))["params"]["layout"] == "zigzag"
    heading = re.search(r"<h1>(.*?)</h1>", page, re.S)
    assert heading is not None and "layout=zigzag" in html.unescape(heading.group(1))


def test_plan_and_inner_params_are_resolved_where_the_device_is_known() -> None:
    spec = {"name": "x", "base": {**RING, "kernel": "ulysses", "params": {"inner": "dilated"}},
            "grid": {"device": ["cpu", "auto"]}}  # fmt: skip
    got = {c.config.device: c.config.params for c in expand(SweepSpec.model_validate(spec))}
    assert got["cpu"]["segment_lengths"] == [2048, 4096, 8192]  # dilated's defaults
    assert got["cpu"]["plan"] == "cpu" and got["auto"]["plan"] == "auto"  # the rank decides
    assert got["cpu"]["block_size"] is None  # not dilated's: stays unset
    dilated = {
        "kernel": "ring_dilated",
        "params": {"segment_lengths": [256], "dilation_rates": [1]},
    }
    (cell,) = expand(SweepSpec.model_validate({"name": "y", "base": {**RING, **dilated}}))
    assert cell.config.params["layout"] == "contiguous" and cell.config.params["plan"] == "cpu"


def test_a_cell_stored_before_resolution_is_the_same_cell() -> None:
    """Sweeps stored with layout null and plan auto still pair with the resolved ones."""
    (cell,) = expand(SweepSpec.model_validate({"name": "z", "base": {**RING, "causal": True}}))
    old = {**cell.config_json, "params": {**cell.config_json["params"], "layout": None}}
    assert _match_key(old) == _match_key(cell.config_json)
    assert resolved.as_given("dilated", {"plan": "cpu"}, causal=False, device="cpu") == {}
    assert resolved.as_given("dilated", {"plan": "cuda"}, causal=False, device="cpu") == {
        "plan": "cuda"
    }


def test_a_default_asked_for_is_not_named_in_the_label(base: str) -> None:
    """ring (zigzag) beside ulysses (its inner kernel left to the default, dense) in one sweep:
    the labels name nothing but the kernels (zigzag is a causal ring's default, inner=dense
    ulysses'), and a default written out (`inner: dense`) is the same cell as one left unset."""
    spec = {
        "name": "schemes",
        "base": {**RING, "causal": True},
        "zip": {"kernel": ["ring", "ulysses"], "params": [{"layout": "zigzag"}, {}]},
    }
    sweep = httpx.post(f"{base}/api/v1/sweeps", json=spec).json()["id"]
    rows = httpx.get(f"{base}/api/v1/sweeps/{sweep}/results.json").json()
    assert [r["label"] for r in rows] == ["ring", "ulysses"], rows
    report = httpx.get(f"{base}/api/v1/sweeps/{sweep}/report.md").text
    (line,) = [x for x in report.splitlines() if x.startswith("**Kernels as run**")]
    assert "ring: layout=zigzag" in line and "ulysses: inner=dense" in line, line
    twice = {**spec, "zip": {"kernel": ["ulysses", "ulysses"], "params": [{}, {"inner": "dense"}]}}
    refused = httpx.post(f"{base}/api/v1/sweeps", json=twice)
    assert refused.status_code == 422 and "duplicate cell" in refused.text
    assert resolved.as_given("ulysses", {"inner": "dense"}, causal=True, device="cpu") == {}
    assert resolved.as_given("dilated", {"ordering": "natural"}, causal=False, device="cpu") == {}
    assert resolved.as_given("dilated", {"ordering": "hilbert"}, causal=False, device="cpu") == {
        "ordering": "hilbert"
    }
