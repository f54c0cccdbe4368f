"""`ringlab serve` outlives its Ray: a real `ray start --head --block` on its own port is
killed -9 mid-sweep and started again (a new cluster, a new cluster ID). The API answers
throughout (/readyz and the run list, each within 1 s), the runs in flight are requeued with
the reason within 10 s, serve reconnects, every run ends succeeded with one result each and
attempts 1, and a SIGTERM then stops serve within 10 s. The timeline is printed (pytest -s)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _api_helpers import free_port, start_serve

pytestmark = [pytest.mark.ray_process, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent
API = "/api/v1"
SPEC = {
    "name": "outlives-ray",
    "base": {
        "kernel": "dense",
        "num_heads": 2,
        "head_dim": 16,
        "device": "cpu",
        "warmup": 1,
        "iterations": 50,
    },
    "grid": {"seq_len": [256, 320, 384]},
}


def _head(env: dict[str, str], port: int, temp: Path) -> subprocess.Popen[bytes]:
    """`ray start --head --block` on `port`, in a session of its own (killed as one group)."""
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
        "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temp}",
        f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
        "--disable-usage-stats",
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


class Watcher:
    """Polls /readyz and the sweep's run list every 0.25 s with a 1 s timeout, recording
    every request that did not answer, and when each run was first seen requeued by the
    loss, and each run's status over time."""

    def __init__(self, base: str, sweep_id: int) -> None:
        self.base, self.sweep_id = base, sweep_id
        self.unanswered: list[str] = []
        self.requeued: dict[int, float] = {}
        self.ray_ok_at: list[float] = []
        self.moves: dict[int, list[str]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.base, timeout=1.0) as http:
            while not self.stop.wait(0.25):
                self._once(http)

    def _once(self, http: httpx.Client) -> None:
        now = time.monotonic()
        try:
            ready = http.get(f"{API}/readyz")
            runs = http.get(f"{API}/runs", params={"sweep_id": self.sweep_id}).json()["data"]
        except httpx.HTTPError as e:
            self.unanswered.append(f"{time.monotonic() - now:.2f} s: {e!r}")
            return
        if ready.json()["checks"]["ray"] == "ok":
            self.ray_ok_at.append(now)
        for run in runs:
            seen = self.moves.setdefault(run["id"], [])
            if not seen or seen[-1] != run["status"]:
                seen.append(run["status"])
            if "lost at" in (run.get("error") or "") and run["id"] not in self.requeued:
                self.requeued[run["id"]] = now
                assert run["status"] == "queued", run


def _wait(what: str, check: Any, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_serve_outlives_its_ray_and_finishes_every_run(tmp_path: Path) -> None:
    temp = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))  # short: unix socket paths
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {
        **os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
    }  # fmt: skip
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(key, None)
    ray_port, api_port = free_port(), free_port()
    base = f"http://127.0.0.1:{api_port}"
    heads = [_head(env, ray_port, temp / "a")]
    serve = start_serve(
        api_port,
        {**env, "RINGLAB_RAY_ADDRESS": f"127.0.0.1:{ray_port}",
         "RINGLAB_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}"},
        tmp_path / "serve.log",
    )  # fmt: skip
    watcher: Watcher | None = None
    try:
        _wait("serve answers", lambda: _answers(base), 60)
        sweep_id = httpx.post(f"{base}{API}/sweeps", json=SPEC, timeout=10).json()["id"]
        watcher = Watcher(base, sweep_id)
        watcher.thread.start()
        _wait("a run is running", lambda: _statuses(base, sweep_id).count("running") >= 1, 120)
        os.killpg(heads[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        marked = _wait("the runs in flight requeued", lambda: watcher.requeued, 10)
        heads.append(_head(env, ray_port, temp / "b"))
        restarted = time.monotonic()
        reconnected = _wait(
            "ray ok again", lambda: any(t > restarted for t in watcher.ray_ok_at), 120
        )
        rerun = _wait(
            "an interrupted run claimed again",
            lambda: any(watcher.moves[i][-1] != "queued" for i in watcher.requeued),
            120,
        )
        done = _wait("every run ended", lambda: _done(base, sweep_id), 180)
        watcher.stop.set()
        watcher.thread.join()
        print(
            f"\ntimeline from the kill -9 (s): runs requeued {marked - killed:.1f}, Ray restarted "
            f"{restarted - killed:.1f}, reconnected {reconnected - killed:.1f}, interrupted run "
            f"claimed again {rerun - killed:.1f}, all runs ended {done - killed:.1f}"
        )
        _check_runs(base, sweep_id, watcher)
        assert watcher.unanswered == [], watcher.unanswered
        serve.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        serve.wait(timeout=10)
        print(f"SIGTERM to exit: {time.monotonic() - t0:.1f} s")
    except BaseException:
        print((tmp_path / "serve.log").read_text()[-6000:])
        raise
    finally:
        if watcher is not None:
            watcher.stop.set()
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        for head in heads:
            if head.poll() is None:
                os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}{API}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _statuses(base: str, sweep_id: int) -> list[str]:
    runs = httpx.get(f"{base}{API}/runs", params={"sweep_id": sweep_id}, timeout=5).json()["data"]
    return [r["status"] for r in runs]


def _done(base: str, sweep_id: int) -> bool:
    return bool(httpx.get(f"{base}{API}/sweeps/{sweep_id}", timeout=5).json()["done"])


def _check_runs(base: str, sweep_id: int, watcher: Watcher) -> None:
    """Every run succeeded once: one rank result, attempts 1; the requeued ones went back to
    the queue once."""
    runs = httpx.get(f"{base}{API}/runs", params={"sweep_id": sweep_id}, timeout=5).json()["data"]
    assert len(runs) == 3
    for run in runs:
        detail = httpx.get(f"{base}{API}/runs/{run['id']}", timeout=5).json()
        assert detail["status"] == "succeeded", detail
        assert detail["attempts"] == 1, detail
        assert len(detail["rank_results"]) == 1, detail
    for run_id in watcher.requeued:  # (succeeded above: the watcher, stopped once the sweep
        moves = watcher.moves[run_id]  # was done, may not have polled the last move)
        assert moves.count("queued") <= 2, moves
