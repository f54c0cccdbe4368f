"""A simulated multi-node Ray cluster, set up the way docs/deploy.md describes, runs a sweep.

Two nodes on this machine started with the real `ray start` command (a head with 1 CPU on its own
port, a worker joining it with 2 CPUs), Ray token authentication on (the token in the nodes'
~/.ray/auth_token, as `ray up` copies it), the API and the scheduler started on the "head" by
deploy/start-head-services.sh (what deploy/ray-cluster*.yaml run), a two-rank sweep submitted
through the API. It completes with one rank on each node. Only the processes this test started
are stopped (by their session ids): never `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
API = "/api/v1"
POSTGRES_URL_ENV = "RINGLAB_TEST_POSTGRES_URL"
PLACEMENT_REPORT = """
import json, os, ray
from ray._private.state import actors
ray.init(address=os.environ["RINGLAB_RAY_ADDRESS"], log_to_driver=False)
ranks = {a["Address"]["NodeID"] for a in actors().values()
         if a["ActorClassName"].endswith("RankActor")}
nodes = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
print(json.dumps({"ranks": sorted(ranks), "nodes": nodes}))
"""
"""Which nodes rank actors ran on, and every alive node's CPUs (printed as one JSON line)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check: Callable[[], Any], what: str, timeout_s: float, detail: Callable[[], str]) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` and `detail()`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{detail()}")


def _sessions_alive(sids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose session id is one of `sids`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) in sids:
            pids.append(int(entry))
    return pids


def _kill_sessions(sids: set[int], grace_s: float) -> list[int]:
    """SIGTERM every process of these sessions, SIGKILL what outlives `grace_s`; the leftovers."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in _sessions_alive(sids):
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _sessions_alive(sids) and time.monotonic() < deadline:
            time.sleep(0.2)
    return _sessions_alive(sids)


class LocalCluster:
    """Ray nodes started with `ray start` in their own sessions, as an operator would by hand."""

    def __init__(self, home: Path, temp_root: Path) -> None:
        self.home = home
        self.temp_root = temp_root
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.sids: set[int] = set()
        self.env = {
            **os.environ,
            "HOME": str(home),
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
            self.env.pop(key, None)

    def _ray_start(self, name: str, *args: str) -> None:
        cmd = [
            str(BIN / "ray"),
            "start",
            *args,
            f"--temp-dir={self.temp_root / name}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--disable-usage-stats",
        ]
        proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its daemons keep this session id: that is how we stop them
        )
        self.sids.add(proc.pid)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}"

    def start_head(self, num_cpus: int) -> None:
        # docs/deploy.md: ray start --head --port=6380 (here a free port: 6379/6380 may be taken)
        self._ray_start(
            "head",
            "--head",
            f"--port={self.port}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            "--include-dashboard=false",
            f"--ray-client-server-port={_free_port()}",
        )

    def join_worker(self, name: str, num_cpus: int) -> None:
        # docs/deploy.md: ray start --address=<head>:6380 on every other node
        self._ray_start(name, f"--address={self.address}", f"--num-cpus={num_cpus}", "--num-gpus=0")

    def driver_via_entrypoint(self, code: str) -> str:
        """Run `code` as the compose api/scheduler containers run ringlab: through
        deploy/docker-entrypoint.sh with RINGLAB_JOIN_RAY=1, which first joins this cluster as a
        node with no CPUs and no GPUs. Returns the driver's stdout."""
        env = {**self.env, "RINGLAB_JOIN_RAY": "1", "RINGLAB_RAY_ADDRESS": self.address}
        proc = subprocess.Popen(
            ["bash", str(ROOT / "deploy" / "docker-entrypoint.sh"), sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the joined node's daemons are stopped with the cluster
        )
        self.sids.add(proc.pid)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        return out

    def stop(self) -> list[int]:
        return _kill_sessions(self.sids, grace_s=10.0)


@pytest.fixture
def database_url_for_cluster() -> Iterator[str]:
    """The cluster's shared database: a fresh schema in the real Postgres, else a SQLite file."""
    raw = os.environ.get(POSTGRES_URL_ENV)
    if not raw:
        tmp = Path(tempfile.mkdtemp(prefix="ringlab-deploy-db"))
        try:
            yield f"sqlite:///{tmp / 'ringlab.db'}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    from service.core.config import normalize_database_url
    from service.db.engine import scratch_schema

    with scratch_schema(normalize_database_url(raw), "t_") as url:
        yield url


@pytest.fixture
def two_node_cluster() -> Iterator[LocalCluster]:
    """Head (1 CPU) + worker (2 CPUs) with token auth; every process of it stopped afterwards."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # the session's local Ray: not needed here, and 2 cores are few
    home = Path(tempfile.mkdtemp(prefix="rlhome"))
    temp_root = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))  # short: unix socket paths
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # `ray get-auth-token`
    cluster = LocalCluster(home, temp_root)
    try:
        cluster.start_head(num_cpus=1)
        cluster.join_worker("worker1", num_cpus=2)
        yield cluster
    finally:
        leftovers = cluster.stop()
        shutil.rmtree(temp_root, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    assert not leftovers, f"Ray processes left behind: {leftovers}"


def _read_pid(log_dir: Path, name: str) -> int | None:
    path = log_dir / f"{name}.pid"
    return int(path.read_text()) if path.exists() else None


def _tail(log_dir: Path) -> str:
    parts = []
    for log in sorted(log_dir.glob("*.log")):
        parts.append(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts) or "(no logs)"


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_two_node_cluster_runs_a_spread_sweep_through_the_service(
    two_node_cluster: LocalCluster, database_url_for_cluster: str
) -> None:
    cluster = two_node_cluster
    log_dir = cluster.home / "ringlab-logs"

    def logs() -> str:
        return _tail(log_dir)

    token = secrets.token_urlsafe(16)
    port = _free_port()
    # deploy/ringlab.env as docs/deploy.md has it for a cluster (secrets, the shared database).
    (cluster.home / "ringlab.env").write_text(
        f"RINGLAB_API_TOKEN={token}\n"
        f"RINGLAB_DATABASE_URL='{database_url_for_cluster}'\n"
        f"RINGLAB_PORT={port}\n"
    )
    env = {**cluster.env, "RINGLAB_RAY_PORT": str(cluster.port)}
    started = subprocess.run(
        ["bash", str(ROOT / "deploy" / "start-head-services.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    service_sids = {pid for name in ("api", "scheduler") if (pid := _read_pid(log_dir, name))}
    try:
        assert started.returncode == 0, f"{started.stdout}\n{started.stderr}\n{logs()}"
        assert len(service_sids) == 2, started.stdout
        base = f"http://127.0.0.1:{port}{API}"
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base, timeout=30) as client:
            # The API sees both nodes (GET /api/v1/cluster, what `ringlab cluster` shows).
            def both_nodes() -> dict[str, Any] | None:
                body = client.get("/cluster").json()
                return body if len(body.get("nodes", [])) == 2 else None

            cluster_info = _wait(both_nodes, "two nodes in GET /cluster", 60, logs)
            assert sorted(n["cpus"] for n in cluster_info["nodes"]) == [1.0, 2.0]
            node_ids = {n["node_id"] for n in cluster_info["nodes"]}
            # `ringlab cluster`: the same view through the CLI, a client of the API.
            shown = subprocess.run(
                [str(BIN / "ringlab"), "cluster"],
                env={**env, "RINGLAB_URL": f"http://127.0.0.1:{port}", "COLUMNS": "200"},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert shown.returncode == 0, shown.stderr
            assert "/3 CPUs free" in shown.stdout and "0/0 GPUs" in shown.stdout, shown.stdout

            spec = {
                "name": "two-nodes",
                "kind": "benchmark",
                "base": {
                    "kernel": "dense",
                    "num_heads": 2,
                    "head_dim": 16,
                    "batch_size": 2,
                    "world_size": 2,
                    "parallel": "data",
                    "device": "cpu",
                    "placement": "spread",
                    "warmup": 1,
                    "iterations": 2,
                    "timeout_s": 150,
                    "dist_timeout_s": 60,
                },
                "grid": {"seq_len": [64]},
            }
            assert client.post("/sweeps", json=spec).status_code == 401  # token required
            created = client.post("/sweeps", json=spec, headers=auth)
            assert created.status_code == 201, created.text
            sweep_id = created.json()["id"]

            def finished() -> dict[str, Any] | None:
                body = client.get(f"/sweeps/{sweep_id}").json()
                return body if body["done"] else None

            sweep = _wait(finished, f"sweep {sweep_id} to finish", 150, logs)
            assert sweep["counts"]["succeeded"] == 1, sweep
            runs = client.get("/runs", params={"sweep_id": sweep_id}).json()["data"]
            assert len(runs) == 1 and runs[0]["status"] == "succeeded", runs
            run = client.get(f"/runs/{runs[0]['id']}").json()

        ranks = run["rank_results"]
        assert [r["rank"] for r in ranks] == [0, 1], run
        for r in ranks:
            assert r["tokens_per_s"] > 0 and r["median_s"] > 0 and r["flops_per_s"] > 0, r
            assert r["peak_memory_bytes"] >= 0 and len(r["times_s"]) == 2, r

        # Where the ranks ran: Ray's actor table (the database stores hosts, and both nodes are
        # this host), read by a driver that joins the way the compose containers do.
        report = cluster.driver_via_entrypoint(PLACEMENT_REPORT)
        seen = json.loads(report.strip().splitlines()[-1])
        assert set(seen["ranks"]) == node_ids, f"rank actors ran on {seen}, nodes are {node_ids}"
        joined = set(seen["nodes"]) - node_ids
        assert len(joined) == 1 and seen["nodes"][joined.pop()] == 0, seen  # an empty node
    finally:
        leftovers = _kill_sessions(service_sids, grace_s=30.0)
    assert not leftovers, f"api/scheduler processes left behind: {leftovers}"
