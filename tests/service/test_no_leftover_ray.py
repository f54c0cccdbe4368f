"""`ringlab serve` leaves no Ray process behind, after a Ctrl-C (SIGINT to the whole process
group, as a terminal sends it: the raylet dies at once without stopping its agents) or a
SIGTERM to the service alone. Each case starts a real local Ray in a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _api_helpers import free_port

from workers.local_ray import cmdline

pytestmark = [pytest.mark.timeout(180), pytest.mark.ray_process]

AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _session_agents(sid: int) -> list[int]:
    """Ray agents in process session `sid` (the service's: they keep it when orphaned)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid and cmdline(int(entry.name)).startswith(AGENTS):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_serve_leaves_no_ray_agents(tmp_path: Path, how: str) -> None:
    port = free_port()
    env = {**os.environ, "RINGLAB_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}"}
    env.pop("RINGLAB_RAY_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 90
        agents: list[int] = []
        while time.monotonic() < deadline and len(agents) < len(AGENTS):
            time.sleep(0.5)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            agents = _session_agents(proc.pid)
        assert len(agents) == len(AGENTS), "the local Ray's agents never started"
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz").status_code == 200
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(cmdline(p) for p in agents):
            time.sleep(0.5)
        left = {p: cmdline(p) for p in agents if cmdline(p)}
        assert left == {}, f"left running after {how}: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _session_agents(proc.pid):
            os.kill(pid, signal.SIGKILL)
