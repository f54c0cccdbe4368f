"""First-hour mistakes answered where they happen: a max_seq_len sweep without its search block,
a required run config field left out, and /sweeps typed into the browser."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from service import cli
from service.cli import console
from service.db.models import Run, Sweep

API = "/api/v1"
BASE = {"kernel": "dense", "num_heads": 2, "head_dim": 16, "warmup": 1, "iterations": 1}
TINY_MODEL = {"name": "tiny", "d_model": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 256}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """The real app (API and dashboard) on a fresh SQLite file."""
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as c:
        yield c


def _stored(client: TestClient) -> tuple[int, int]:
    with client.app.state.sessionmaker() as s:  # type: ignore[attr-defined]
        sweeps = s.scalar(select(func.count()).select_from(Sweep))
        runs = s.scalar(select(func.count()).select_from(Run))
        return sweeps, runs


def _refused(client: TestClient, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """POST the spec; it must be a 422 that stores nothing. Returns the errors."""
    r = client.post(f"{API}/sweeps", json=spec)
    assert r.status_code == 422, r.text
    assert _stored(client) == (0, 0)
    return r.json()["detail"]


# -- defect 2: a max_seq_len sweep needs its search block ----------------------------------------


def test_max_seq_len_sweep_without_search_is_422_at_search(client: TestClient) -> None:
    spec = {"name": "no search", "kind": "max_seq_len", "base": BASE}
    (err,) = _refused(client, spec)
    assert err["loc"] == ["body", "search"]
    assert "max_seq_len sweep needs a search block" in err["msg"]
    assert "start, max, granularity" in err["msg"]

    # with the block the same sweep is accepted, and searches exactly what it says
    spec["search"] = {"start": 256, "max": 2048, "granularity": 256}
    r = client.post(f"{API}/sweeps", json=spec)
    assert r.status_code == 201, r.text
    (run,) = client.get(f"{API}/runs", params={"sweep_id": r.json()["id"]}).json()["data"]
    assert run["seq_len"] == 256
    assert run["config"]["search"] == {
        "start": 256,
        "max": 2048,
        "granularity": 256,
        "fresh_processes": False,
    }
    assert _stored(client) == (1, 1)


def test_missing_search_is_reported_with_the_other_structure_errors(client: TestClient) -> None:
    """One answer names every structural mistake: the missing block and a searched seq_len."""
    spec = {"name": "m", "kind": "max_seq_len", "base": BASE, "grid": {"seq_len": [1024]}}
    locs = [e["loc"] for e in _refused(client, spec)]
    assert locs == [["body", "grid", "seq_len"], ["body", "search"]]


# -- defect 3: a missing required field is named --------------------------------------------------


def test_missing_seq_len_is_named_base_seq_len(client: TestClient) -> None:
    (err,) = _refused(client, {"name": "no length", "base": BASE})
    assert err["loc"] == ["body", "base", "seq_len"]
    assert err["msg"] == "Field required" and err["type"] == "missing"


def test_every_missing_field_is_named_once(client: TestClient) -> None:
    errs = _refused(client, {"name": "empty", "base": {}, "grid": {"batch_size": [1, 2]}})
    # both fields, each at its own place (not one merged "base: Field required")
    assert sorted(tuple(e["loc"]) for e in errs) == [
        ("body", "base", "kernel"),
        ("body", "base", "seq_len"),
    ]
    assert all(e["msg"].startswith("Field required (cell batch_size=1)") for e in errs)


def test_a_field_a_validator_requires_is_named(client: TestClient) -> None:
    """A model cell without a model: the model validator's refusal names base.model."""
    spec = {"name": "no model", "base": {**BASE, "seq_len": 64, "workload": "model"}}
    (err,) = _refused(client, spec)
    assert err["loc"] == ["body", "base", "model"]
    assert "needs a model" in err["msg"]


def test_missing_nested_field_names_where_the_object_was_written(client: TestClient) -> None:
    # a model cell's heads and head size come from its model: none in the base
    model_base = {"kernel": "dense", "seq_len": 64, "workload": "model", "device": "cpu"}
    partial = {k: v for k, v in TINY_MODEL.items() if k != "d_model"}
    errs = _refused(client, {"name": "m", "base": {**model_base, "model": partial}})
    assert [e["loc"] for e in errs] == [["body", "base", "model", "d_model"]]
    assert errs[0]["msg"] == "Field required"

    # a whole model object on an axis: the missing field is inside that axis value
    errs = _refused(client, {"name": "m", "base": model_base, "grid": {"model": [partial]}})
    assert [e["loc"] for e in errs] == [["body", "grid", "model", 0, "d_model"]]

    # the same model completed by a model.<field> axis is valid
    spec = {"name": "m", "base": {**model_base, "model": partial}, "grid": {"model.d_model": [64]}}
    r = client.post(f"{API}/sweeps", json=spec)
    assert r.status_code == 201, r.text
    (run,) = client.get(f"{API}/runs", params={"sweep_id": r.json()["id"]}).json()["data"]
    assert run["config"]["model"]["d_model"] == 64


def test_cli_prints_the_missing_field_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ringlab submit` against the real app: one line naming base.seq_len, exit code 1."""
    from _web_helpers import live_server, make_web_app

    from service.core.config import Settings

    spec = tmp_path / "no-length.yaml"
    spec.write_text("name: no length\nbase: {kernel: dense, num_heads: 2, head_dim: 16}\n")
    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'ringlab.db'}"))
    with live_server(app) as base:
        monkeypatch.setenv("RINGLAB_URL", base)
        monkeypatch.delenv("RINGLAB_API_TOKEN", raising=False)
        monkeypatch.setattr(console.out, "width", 200)
        result = CliRunner().invoke(cli.app, ["submit", str(spec)], catch_exceptions=False)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith("nothing submitted: base.seq_len: Field required"), line


# -- defect 7: /sweeps in the browser --------------------------------------------------------------


def test_sweeps_redirects_to_the_sweep_list(client: TestClient) -> None:
    for name in ("first", "second"):
        spec = {"name": name, "base": {**BASE, "seq_len": 64}}
        assert client.post(f"{API}/sweeps", json=spec).status_code == 201

    r = client.get("/sweeps", follow_redirects=False)
    assert r.status_code in (307, 308) and r.headers["location"] == "/"
    r = client.get("/sweeps", params={"page": 2, "per_page": 1}, follow_redirects=False)
    assert r.status_code in (307, 308)
    assert r.headers["location"] == "/?page=2&per_page=1"

    page = client.get("/sweeps", params={"page": 2, "per_page": 1})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert str(page.url).endswith("/?page=2&per_page=1")
    assert "<h1>Sweeps" in page.text and "2 in all" in page.text
    assert ">first</a>" in page.text and ">second</a>" not in page.text  # page 2, oldest
    assert "page 2 of 2" in page.text

    # a trailing slash lands on the list as well
    assert client.get("/sweeps/").url.path == "/"

    # the API's list is untouched: JSON under /api/v1
    listing = client.get(f"{API}/sweeps")
    assert listing.status_code == 200
    assert [s["name"] for s in listing.json()["data"]] == ["second", "first"]
