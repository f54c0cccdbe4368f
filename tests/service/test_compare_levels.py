"""The compare page, its API and `ringlab compare` state the level their intervals cover and
call a time slower only at 95% or more: with 3 iterations (the demo's, 75%) a 2x slower cell is
"too few iterations to tell", never a regression; with 12 it is a regression.

Sweeps are stored through the API and the scheduler's write path with planted times
(tests/service/test_report_reading.py), served by the real app on a live port for the CLI.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from _web_helpers import live_server, make_web_app
from test_report_reading import CPU, finish_all
from typer.testing import CliRunner

from service import cli
from service.cli import console
from service.core.config import Settings
from workers.noise import median_interval

API = "/api/v1"
THREE = (0.96, 1.0, 1.08)
TWELVE = tuple(0.95 + 0.01 * i for i in range(12))


def _spec(name: str, iterations: int) -> dict[str, Any]:
    base = {**CPU, "kernel": "dense", "iterations": iterations}
    return {"name": "same", "base": base, "grid": {"seq_len": [1024, 2048]}} | {"name": name}


def _pair(client: Any, iterations: int, spread: Any) -> tuple[int, int]:
    """Sweeps A and B of one spec (but the name); B's 2,048 cell planted 2x slower."""
    a = finish_all(client, _spec("A", iterations), lambda c: 1e-3, spread)
    slow = finish_all(client, _spec("B", iterations),
                      lambda c: 2e-3 if c.seq_len == 2048 else 1e-3, spread)  # fmt: skip
    return a, slow


def _gate(base: str, monkeypatch: pytest.MonkeyPatch, a: int, b: int) -> Any:
    monkeypatch.setenv("RINGLAB_URL", base)
    monkeypatch.setattr(console.out, "width", 200)
    args = ["compare", str(a), str(b), "--fail-on-regression", "--threshold", "25%"]
    return CliRunner().invoke(cli.app, args, catch_exceptions=False)


def _text(html: str, element: str) -> str:
    found = re.search(rf'<p id="{element}"[^>]*>(.*?)</p>', html, re.S)
    assert found is not None, html
    return " ".join(found.group(1).split())


def test_three_iterations_are_too_few_to_call_a_regression_twelve_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    three, twelve = median_interval(THREE), median_interval(TWELVE)
    assert three is not None and twelve is not None
    assert three.level == 0.75 and twelve.level > 0.95  # what the page must say, from the binomial
    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}"))
    with live_server(app) as base, httpx.Client(base_url=base) as http:
        from fastapi.testclient import TestClient

        with TestClient(app, base_url="http://localhost") as client:
            few = _pair(client, 3, THREE)
            many = _pair(client, 12, TWELVE)
        api_few = http.get(f"{API}/sweeps/{few[0]}/compare/{few[1]}").json()
        api_many = http.get(f"{API}/sweeps/{many[0]}/compare/{many[1]}").json()
        page_few = http.get("/compare", params={"a": few[0], "b": few[1]}).text
        page_many = http.get("/compare", params={"a": many[0], "b": many[1]}).text
        history = http.get("/cells/history", params={"run": 1}).text  # sweep A's first run
        gate_few = _gate(base, monkeypatch, *few)
        gate_many = _gate(base, monkeypatch, *many)

    # 3 iterations: the ranges [0.96, 1.08] ms and [1.92, 2.16] ms miss each other, at 75% each
    slow = next(p for p in api_few["pairs"] if p["label"].endswith("2,048"))
    assert slow["time_ratio"] == pytest.approx(2.0) and slow["tps_hi"] < 1
    assert slow["time_verdict"] == "too few iterations to tell" and slow["time_change"] is None
    assert not slow["regression"] and (slow["a_median_ci_level"], slow["a_iterations"]) == (0.75, 3)
    assert api_few["regressions"] == 0 and api_few["too_few"] == 2
    assert "cover 75%." in _text(page_few, "levels")
    verdict = _text(page_few, "verdict")
    assert "0 regressions" in verdict and "2 too few iterations to tell" in verdict, verdict
    assert "95% confidence" not in page_few and "every difference" not in page_few
    assert "(0.96 ms-1.08 ms, 75%, n=3)" in page_few
    assert "interval at 75%" in history and "75%, n=3)" in history, history
    assert gate_few.exit_code == 0, gate_few.stdout
    (untold,) = [line for line in gate_few.stdout.splitlines() if line.startswith("untold ")]
    assert "B/A 2.00" in untold and "too few iterations to tell" in untold and "75%" in untold
    assert "0 worse" in gate_few.stdout

    # 12 iterations: the same 2x is beyond both intervals at 99.4%: a regression, said so
    slow = next(p for p in api_many["pairs"] if p["label"].endswith("2,048"))
    assert slow["time_change"] == "slower" and slow["regression"] and api_many["too_few"] == 0
    assert f"cover {100 * twelve.level:.3g}%." in _text(page_many, "levels")
    assert "1 regressions" in _text(page_many, "verdict")
    assert gate_many.exit_code == 1 and "1 worse" in gate_many.stdout, gate_many.stdout
