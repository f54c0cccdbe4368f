"""Unknown fields in a sweep spec as the researcher reads them, from the API and from
`ringlab submit`: each with the nearest valid name ("did you mean"), every one listed on its
own line (up to 10, the rest counted), none hidden behind "and 1 more"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from _api_helpers import api_client
from _web_helpers import live_server, make_web_app
from typer.testing import CliRunner

from service import cli
from service.cli import console
from service.core.config import Settings

API = "/api/v1"
BASE = {"kernel": "dense", "device": "cpu", "seq_len": 128}


def test_the_api_adds_did_you_mean_to_each_unknown_field(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 's.db'}") as client:
        typos = {"name": "t", "base": {**BASE, "num_head": 2, "warmpu": 1}}
        base = client.post(f"{API}/sweeps", json=typos).json()["detail"]
        top = client.post(f"{API}/sweeps", json={"name": "t", "base": BASE, "gird": {}})
        axis = {"name": "t", "base": BASE, "grid": {"wold_size": [1]}}
        axes = client.post(f"{API}/sweeps", json=axis).json()["detail"]
    assert [e["msg"] for e in base] == [
        "unknown run config field 'num_head'; did you mean 'num_heads'?",
        "unknown run config field 'warmpu'; did you mean 'warmup'?",
    ]
    (error,) = top.json()["detail"]
    assert error["loc"] == ["body", "gird"] and error["msg"].endswith("did you mean 'grid'?")
    (error,) = axes
    assert error["msg"].startswith("unknown axis 'wold_size'; did you mean 'world_size'? valid: ")


def test_the_hint_reaches_one_document_of_many_and_a_kernels_params(tmp_path: Path) -> None:
    """A typo inside one document of a multi-document file gets the hint a lone spec gets, and
    a params typo gets it from the kernel's valid names, whatever cell the message names."""
    with api_client(f"sqlite:///{tmp_path / 's.db'}") as client:
        docs = {"documents": [{"name": "a", "base": BASE, "gird": {}},
                              {"name": "b", "base": {**BASE, "num_head": 2}}]}  # fmt: skip
        many = client.post(f"{API}/sweeps", json=docs)
        dry = client.post(f"{API}/sweeps", params={"dry_run": "true"}, json=docs).json()
        ring = {**BASE, "kernel": "ring", "world_size": 2, "params": {"layuot": "zigzag"}}
        grid = {"seq_len": [128, 256]}  # each error names its cell after the valid names
        params = client.post(f"{API}/sweeps", json={"name": "t", "base": ring, "grid": grid})
    hints = {tuple(e["loc"]): e["msg"] for e in many.json()["detail"]}
    assert hints[("body", "documents", 1, "base", "num_head")].endswith(
        "did you mean 'num_heads'?"
    ), hints
    assert hints[("body", "documents", 0, "gird")].endswith("did you mean 'grid'?"), hints
    checked = {tuple(e["loc"]): e["msg"] for d in dry["documents"] for e in d["problems"]}
    assert {("body", *loc): msg for loc, msg in checked.items()} == hints, "a dry run says the same"
    errors = params.json()["detail"]
    assert errors and all("ring'; did you mean 'layout'? valid: " in e["msg"] for e in errors)


def _submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]) -> Any:
    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'cli.db'}"))
    file = tmp_path / "spec.yaml"
    file.write_text(yaml.safe_dump(spec))
    with live_server(app) as base:
        monkeypatch.setenv("RINGLAB_URL", base)
        monkeypatch.setattr(console.err, "width", 200)
        return CliRunner().invoke(cli.app, ["submit", str(file)], catch_exceptions=False)


def test_ringlab_submit_lists_every_problem_with_its_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    two = _submit(tmp_path, monkeypatch, {"name": "t", "base": {**BASE, "num_head": 2,
                                                                 "warmpu": 1}})  # fmt: skip
    assert two.exit_code == 1
    assert two.stderr.splitlines() == [
        f"error: {tmp_path / 'spec.yaml'}: nothing submitted: 2 problems; fix them and submit "
        "again",
        "  base.num_head: unknown run config field 'num_head'; did you mean 'num_heads'?",
        "  base.warmpu: unknown run config field 'warmpu'; did you mean 'warmup'?",
    ], two.stderr
    many = {f"field_{i:02d}": 1 for i in range(12)}
    twelve = _submit(tmp_path, monkeypatch, {"name": "t", "base": {**BASE, **many}})
    lines = twelve.stderr.splitlines()
    assert lines[0] == (
        f"error: {tmp_path / 'spec.yaml'}: nothing submitted: 12 problems; fix them and submit "
        "again"
    ), twelve.stderr
    assert lines[1:11] == [f"  base.field_{i:02d}: unknown run config field 'field_{i:02d}'"
                           for i in range(10)], twelve.stderr  # fmt: skip
    assert lines[11:] == ["  ... and 2 more not shown"], twelve.stderr
