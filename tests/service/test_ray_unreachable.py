"""A scheduler that cannot reach Ray retries with backoff, logs why in one line, and /readyz
answers 503 naming Ray and the reason, never "connecting" for ever; queued runs and their sweep
(API and run page), the dashboard's header and `ringlab cluster` (one line, exit 1) say the
same: the issue's case, a live Ray cluster whose auth token this `ringlab serve` lacks (the
session's local Ray, joined with a wrong token from a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

SERVE = """
import json, logging, sys, time
from fastapi.testclient import TestClient
from typer.testing import CliRunner
from service import cli
from service.cli import sweeps
from service import client as ringlab_client
from service.app import create_app
from service.core.config import Settings

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
settings = Settings(database_url=sys.argv[1], ray_address=sys.argv[2])
with TestClient(create_app(settings, with_scheduler=True), base_url="http://localhost") as client:
    seen = []
    t0 = time.monotonic()
    deadline = t0 + 60
    while time.monotonic() < deadline:
        r = client.get("/api/v1/readyz")
        seen.append((r.status_code, r.json()["checks"], time.monotonic() - t0))
        if "unreachable" in r.json()["checks"]["ray"]:
            break
        time.sleep(0.2)
    cluster = client.get("/api/v1/cluster")
    # what a user looks at while Ray stays unreachable: the queued run, its sweep, the pages,
    # and `ringlab cluster` (its client on this app)
    spec = {"name": "q", "base": {"kernel": "dense", "seq_len": 64, "num_heads": 2,
            "head_dim": 16, "device": "cpu"}}
    sweep = client.post("/api/v1/sweeps", json=spec).json()
    runs = client.get("/api/v1/runs", params={"sweep_id": sweep["id"]}).json()["data"]
    run = client.get(f"/api/v1/runs/{runs[0]['id']}").json()
    pages = {p: client.get(p).text for p in ("/", f"/runs/{run['id']}")}
    out = {
        "seen": seen, "cluster": [cluster.status_code, cluster.json()],
        "sweep": [sweep, client.get(f"/api/v1/sweeps/{sweep['id']}").json()],
        "runs": [runs, run], "pages": pages,
    }
    c = ringlab_client.Client("http://localhost")
    c.http = client  # (the command closes its client: last)
    sweeps.client = lambda: c
    done = CliRunner().invoke(cli.app, ["cluster"])
    print(json.dumps({**out, "cli": [done.exit_code, done.stdout, done.stderr]}))
"""


def test_unreachable_ray_is_retried_logged_and_named_on_readyz(
    tmp_path: Path, ray_session: Any
) -> None:
    address = ray_session.get_runtime_context().gcs_address
    env = {
        **os.environ,
        "RAY_AUTH_TOKEN": "not-this-clusters-token-0123456789abcdef01234567",
        "RAY_gcs_server_port_wait_time_s": "2",  # Ray's own connect window: ~2 s, not ~20
    }
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, f"sqlite:///{tmp_path / 'r.db'}", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = out["seen"]
    assert all(code == 503 for code, _, _ in seen), seen
    states = [checks["ray"] for _, checks, _ in seen]
    # from the first request on it says what it does: migrating, then connecting (never "not
    # started")
    starting = f"starting: the scheduler migrates the database, then connects to {address}"
    assert all(s.split(" (")[0] == starting for s in states if s.startswith("starting:")), states
    first = next(s for s in states if not s.startswith("starting:"))
    last = states[-1]
    assert first.startswith(f"connecting to {address}: attempt 1"), first
    assert not any("not started" in s for s in states), states
    # Ray's auth failure is named, with what to set, within 5 s of the first request (Ray
    # itself retries it for tens of seconds and says it only in its log)
    assert last.startswith(
        f"unreachable: cannot connect to {address} (InvalidAuthToken: Authentication token is "
        "missing or incorrect (this process' Ray auth token is missing or not the cluster's: "
        "set RAY_AUTH_MODE=token"
    ), last
    assert "attempt 2 in" in last
    assert seen[-1][2] <= 5.0, f"named after {seen[-1][2]:.1f} s: {seen}"
    assert all(checks["scheduler"] == "running" for _, checks, _ in seen), "it did not stop"
    log_lines = [x for x in proc.stderr.splitlines() if "cannot connect to Ray at" in x]
    assert log_lines and "attempt 2 in 1 s" in log_lines[0], proc.stderr[-3000:]
    assert "InvalidAuthToken" in log_lines[0]
    assert out["cluster"][0] == 503 and "unreachable" in json.dumps(out["cluster"][1])
    _says_why_runs_wait(out, address)


def _says_why_runs_wait(out: dict[str, Any], address: str) -> None:
    """Queued runs, their sweep, the dashboard's header, the run page and `ringlab cluster`
    name Ray's address and reason; nothing reads 'connecting'."""
    why = f"queued: the scheduler cannot reach Ray at {address}: InvalidAuthToken: "
    created, got = out["sweep"]
    assert created["waiting"].startswith(why) and got["waiting"].startswith(why), got
    listed, run = out["runs"]
    assert run["status"] == "queued" and run["waiting"].startswith(why), run
    assert all(r["waiting"].startswith(why) for r in listed)
    for path, html in out["pages"].items():
        header = html.split('<header class="top">')[1].split("</header>")[0]
        assert 'id="cluster-problem"' in header and why in html.replace("&#39;", "'"), path
    run_page = next(html for path, html in out["pages"].items() if path.startswith("/runs/"))
    assert '<p class="waiting" id="waiting">queued: the scheduler cannot reach Ray' in run_page
    code, stdout, stderr = out["cli"]
    assert code == 1 and stdout == "", (code, stdout, stderr)
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: ") and f"unreachable: cannot connect to {address}" in line
    assert "InvalidAuthToken" in line
    assert "connecting" not in json.dumps(out["sweep"] + out["runs"]) + line
