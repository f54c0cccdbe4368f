"""With no Ray address configured, `ringlab serve` runs on a Ray of its own, whatever a dead
`ray start` left recorded where Ray looks for one; and a SIGTERM stops it within 10 s, while
it connects to an address that never answers as well as once it has run a sweep.

Ray's record lives in a scratch RAY_TMPDIR: nobody else's Ray on this machine is touched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _api_helpers import finished_sweep, free_port, start_serve

pytestmark = [pytest.mark.ray_process, pytest.mark.timeout(240)]

API = "/api/v1"
SPEC = {
    "name": "own",
    "base": {"kernel": "dense", "seq_len": 64, "num_heads": 2, "head_dim": 16, "device": "cpu"},
}


@pytest.fixture
def scratch_ray_tmpdir() -> Iterator[Path]:
    """A RAY_TMPDIR whose ray/ray_current_cluster names a dead cluster (nothing listens)."""
    root = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))  # short: unix socket paths
    (root / "ray").mkdir()
    (root / "ray" / "ray_current_cluster").write_text(f"192.0.2.2:{free_port()}")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _serve(tmp_path: Path, port: int, **env: str) -> subprocess.Popen[bytes]:
    full = {**os.environ, "RINGLAB_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}", **env}
    for key in ("RINGLAB_RAY_ADDRESS", "RAY_ADDRESS"):
        if key not in env:
            full.pop(key, None)
    return start_serve(port, full, tmp_path / "serve.log")


def _stops_within(proc: subprocess.Popen[bytes], limit_s: float, log: Path) -> float:
    """SIGTERM; the seconds it took to exit (fails past limit_s, the process killed)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(
            f"still running {limit_s} s after SIGTERM:\n{log.read_text()[-3000:]}"
        ) from None
    return time.monotonic() - t0


def _ray_check(base: str) -> str:
    try:
        return str(httpx.get(f"{base}{API}/readyz", timeout=1).json()["checks"]["ray"])
    except (httpx.HTTPError, ValueError):
        return ""


def test_serve_runs_on_its_own_ray_past_a_dead_recorded_cluster(
    tmp_path: Path, scratch_ray_tmpdir: Path
) -> None:
    port = free_port()
    proc = _serve(tmp_path, port, RAY_TMPDIR=str(scratch_ray_tmpdir))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while _ray_check(base) != "ok":
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()[-3000:]
            time.sleep(0.5)
        sweep = httpx.post(f"{base}{API}/sweeps", json=SPEC, timeout=10).json()
        done = finished_sweep(f"{base}{API}/sweeps/{sweep['id']}", timeout=120, poll_s=0.5)
        assert done["counts"]["succeeded"] == 1, done
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert _stops_within(proc, 10, tmp_path / "serve.log") < 10


def test_sigterm_stops_serve_while_it_connects(tmp_path: Path) -> None:
    port = free_port()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = _serve(tmp_path, port, RINGLAB_RAY_ADDRESS=dead)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ray_check(base).startswith(("connecting to", "unreachable")):
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert _stops_within(proc, 10, tmp_path / "serve.log") < 10
