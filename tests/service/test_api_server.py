"""run_server in a real process: it serves, runs its embedded scheduler, and exits cleanly on
SIGTERM (lifespan shutdown: scheduler stopped and joined, engine disposed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _api_helpers import finished_sweep, free_port

API = "/api/v1"
SERVE = (
    "import sys; from service.app import run_server; from service.core.config import Settings; "
    "run_server(Settings(), '127.0.0.1', int(sys.argv[1]), with_scheduler=sys.argv[2] == '1')"
)


def _start(db: Path, with_scheduler: bool, **env: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port), "1" if with_scheduler else "0"],
        env={**os.environ, "RINGLAB_DATABASE_URL": f"sqlite:///{db}", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.communicate()[0]}")
        try:
            if httpx.get(f"{base}{API}/healthz", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not answer /healthz within 60 s")


def _read_until(proc: subprocess.Popen[str], marker: str, what: str) -> tuple[str, str]:
    """The process' output up to the first line holding `marker`: (that line, all so far)."""
    assert proc.stdout is not None
    seen = ""
    for line in proc.stdout:
        seen += line
        if marker in line:
            return line, seen
    raise AssertionError(f"{what} exited before printing {marker!r}: {seen}")


def _terminate(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, then what the process printed until it exited (killed past 60 s, and raised)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return out


def _sigterm(proc: subprocess.Popen[str]) -> str:
    out = _terminate(proc)
    # uvicorn re-raises the signal after its graceful shutdown: killed-by-SIGTERM is the clean exit
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out, out
    return out


@pytest.mark.timeout(120)
def test_sigterm_shuts_the_server_down_cleanly(tmp_path: Path) -> None:
    proc, base = _start(tmp_path / "serve.db", with_scheduler=False)
    r = httpx.post(
        f"{base}{API}/sweeps",
        json={"name": "s", "base": {"kernel": "dense"}, "grid": {"seq_len": [64, 128]}},
    )
    assert r.status_code == 201
    ready = httpx.get(f"{base}{API}/readyz").json()
    assert ready["checks"]["database"] == "ok" and ready["checks"]["scheduler"] == "not embedded"
    _sigterm(proc)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_serve_with_embedded_scheduler_runs_a_sweep(tmp_path: Path, ray_session: Any) -> None:
    address = ray_session.get_runtime_context().gcs_address  # the tests' shared Ray
    proc, base = _start(tmp_path / "serve.db", with_scheduler=True, RINGLAB_RAY_ADDRESS=address)
    try:
        spec = {
            "name": "served",
            "base": {"kernel": "dense", "num_heads": 2, "head_dim": 16, "device": "cpu"},
            "grid": {"seq_len": [64, 128]},
        }
        sweep_id = httpx.post(f"{base}{API}/sweeps", json=spec).json()["id"]
        sweep = finished_sweep(f"{base}{API}/sweeps/{sweep_id}", timeout=180, poll_s=0.5)
        assert sweep["counts"]["succeeded"] == 2, sweep
        ready = httpx.get(f"{base}{API}/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {"database": "ok", "ray": "ok", "scheduler": "running"}
    except BaseException:
        proc.kill()
        raise
    _sigterm(proc)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_scheduler_process_stops_cleanly_on_sigterm(tmp_path: Path, ray_session: Any) -> None:
    """`ringlab scheduler` keeps its own SIGTERM handler after joining Ray (ray.init installs
    one that exits at once): SIGTERM stops claiming and the process exits 0."""
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "scheduler"],
        env={
            **os.environ,
            "RINGLAB_DATABASE_URL": f"sqlite:///{tmp_path / 'sched.db'}",
            "RINGLAB_RAY_ADDRESS": address,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # printed once Ray is joined and the handlers are in place
    _, seen = _read_until(proc, "SIGTERM or Ctrl-C stops it cleanly", "the scheduler")
    time.sleep(3.0)  # into the claim loop (Ray is joined before the line above)
    out = _terminate(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}: {seen}{out}"
