"""The regression gate on identical specs and identical code, through the real service: five
pairs of real sweeps, each run by the scheduler on the session's local Ray, at the demo's
setting (examples/cpu-quick.yaml: 3 iterations, whose intervals cover 75%). Each pair must
pass `ringlab compare --fail-on-regression --threshold 25%` (exit 0): a time from 3 iterations
is "too few iterations to tell", never a regression, and the compare page of the same pair
says so beside "identical specs" without calling any regression."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from _gang_helpers import run_queue
from _web_helpers import live_server, make_web_app
from typer.testing import CliRunner

from service import cli
from service.cli import console
from service.cli.demo import DEMO_EXAMPLE
from service.cli.specs import load_specs
from service.core.config import Settings

API = "/api/v1"
PAIRS = 5


def _demo_cut_down(name: str) -> dict[str, Any]:
    """The demo's sweep (its base: 3 iterations, 1 warmup) cut down to two short lengths of
    its single-process kernel: after the first run starts the rank process (~10 s here),
    each run takes well under a second."""
    (spec,) = load_specs(DEMO_EXAMPLE)
    base = {**spec["base"], "num_heads": 2, "head_dim": 16, "batch_size": 1}
    return {"name": name, "base": {**base, "kernel": "dense"}, "grid": {"seq_len": [128, 256]}}


def _gate(base: str, monkeypatch: pytest.MonkeyPatch, a: int, b: int) -> Any:
    monkeypatch.setenv("RINGLAB_URL", base)
    monkeypatch.setattr(console.out, "width", 200)
    args = ["compare", str(a), str(b), "--fail-on-regression", "--threshold", "25%"]
    return CliRunner().invoke(cli.app, args, catch_exceptions=False)


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_identical_specs_on_identical_code_pass_the_gate_five_times(
    tmp_path: Path, ray_session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'same.db'}"))
    with live_server(app) as base:
        pairs = [
            [httpx.post(f"{base}{API}/sweeps", json=_demo_cut_down(f"pair {i} {side}")).json()["id"]
             for side in "AB"]
            for i in range(PAIRS)
        ]  # fmt: skip
        run_queue(app.state.sessionmaker)  # one pool for all ten sweeps, in the order submitted
        for i, (a, b) in enumerate(pairs):
            rows = [httpx.get(f"{base}{API}/sweeps/{s}/results.json").json() for s in (a, b)]
            for sweep in rows:
                assert [r["status"] for r in sweep] == ["succeeded"] * 2, sweep
                assert all(r["iterations"] == 3 and r["median_ci_level"] == 0.75 for r in sweep)
            gate = _gate(base, monkeypatch, a, b)
            answer = httpx.get(f"{base}{API}/sweeps/{a}/compare/{b}").json()
            page = httpx.get(f"{base}/compare", params={"a": a, "b": b}).text
            ratios = [p["time_ratio"] for p in answer["pairs"]]
            print(f"pair {i}: B/A median ratios {ratios}; gate:\n{gate.stdout}")
            assert gate.exit_code == 0, (gate.stdout, answer)
            assert "0 worse" in gate.stdout, gate.stdout
            assert answer["same_spec"] and answer["regressions"] == 0, answer
            assert {p["time_verdict"] for p in answer["pairs"]} == {"too few iterations to tell"}
            verdict = re.search(r'<p id="verdict">(.*?)</p>', page, re.S)
            assert verdict is not None and " 0 regressions" in " ".join(verdict[1].split())
            assert "A and B ran identical specs" in page and "cover 75%." in page
