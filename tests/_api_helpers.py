"""Helpers for the API tests: an in-process client, a finished sweep, and stored results (a
live uvicorn server: _web_helpers.live_server)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from _results_helpers import timing
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.app import create_app
from service.core.config import Settings
from service.db.models import Environment, Probe, ProbeOutcome, RankResultRow, Run, RunStatus

TOKEN = "s3cret-token"


def small_spec(name: str = "small", **overrides: Any) -> dict[str, Any]:
    """A 4-cell dense sweep (2 lengths x world 1 and 2, data parallel)."""
    spec: dict[str, Any] = {
        "name": name,
        "base": {
            "kernel": "dense",
            "num_heads": 2,
            "head_dim": 16,
            "batch_size": 2,
            "parallel": "data",
            "warmup": 1,
            "iterations": 2,
        },
        "grid": {"seq_len": [128, 256], "world_size": [1, 2]},
    }
    spec.update(overrides)
    return spec


def as_search(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` (a grid sweep) as a max_seq_len search from 1,024 to 4,096 tokens: its grid
    dropped, its other entries shared with `spec`."""
    rest = {key: value for key, value in spec.items() if key != "grid"}
    return {**rest, "kind": "max_seq_len", "search": {"start": 1024, "max": 4096}}


def refused(client: TestClient, spec: dict[str, Any]) -> dict[str, Any]:
    """The one problem of the 422 that POST /sweeps answers `spec` with."""
    r = client.post("/api/v1/sweeps", json=spec)
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    return problem


@contextmanager
def api_client(database_url: str, **settings: Any) -> Iterator[TestClient]:
    """A TestClient on a fresh app (lifespan run: migrations, engine) for `database_url`."""
    app = create_app(Settings(database_url=database_url, **settings))
    with TestClient(app, base_url="http://localhost") as client:
        yield client


def run_in_process(client: TestClient, spec: dict[str, Any]) -> int:
    """POST `spec`; run each cell's case on this CPU in this process (the engine's own
    protocol) and finish the run through the scheduler's write path; the sweep's id."""
    from service import leases
    from service.results import write
    from workers.config import RunConfig
    from workers.protocol import run_case
    from workers.results import outcome_of

    created = client.post("/api/v1/sweeps", json=spec)
    assert created.status_code == 201, created.text
    sm = client.app.state.sessionmaker  # type: ignore[attr-defined]
    while (claim := leases.claim_next(sm, "test", 60.0)) is not None:
        case = run_case(RunConfig.model_validate(claim.config))
        assert case.status == "ok", case.error
        assert write.finish(sm, claim, write.completion_from_outcome(outcome_of([case], 1)))
    return int(created.json()["id"])


def start_serve(port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`ringlab serve --port port` in a process of its own session (signalled as a group),
    with environment `env`, its stdout and stderr written to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finished_sweep(url: str, timeout: float, poll_s: float = 1.0) -> dict[str, Any]:
    """The sweep at `url` (a live server's /api/v1/sweeps/N) once it is done, polled every
    `poll_s`; fails past `timeout` s with the last state seen."""
    deadline = time.monotonic() + timeout
    sweep: dict[str, Any] = {}
    while time.monotonic() < deadline:
        sweep = httpx.get(url, timeout=10).json()
        if sweep["done"]:
            return sweep
        time.sleep(poll_s)
    raise AssertionError(f"not done within {timeout} s: {sweep}")


def mark_succeeded(session: Session, run_id: int, env_hash: str) -> Run:
    """Run `run_id` marked succeeded on a bare environment `env_hash` (made on first use)."""
    run = session.get(Run, run_id)
    assert run is not None
    env = session.query(Environment).filter_by(hash=env_hash).one_or_none()
    if env is None:
        env = Environment(hash=env_hash, hosts=["vm"], gpus=[], torch="2.13.0", python="3.11")
        session.add(env)
        session.flush()
    run.status, run.environment_id = RunStatus.succeeded, env.id
    return run


def store_result(
    session: Session,
    run_id: int,
    *,
    status: RunStatus = RunStatus.succeeded,
    medians: tuple[float, ...] = (0.01,),
    peak: int = 1 << 20,
    flops: float = 1e9,
    probes: tuple[tuple[int, ProbeOutcome, int | None], ...] = (),
    error: str | None = None,
) -> None:
    """Write what a finished run leaves in the database: rank results, probes, environment."""
    run = session.get(Run, run_id)
    assert run is not None
    env = session.query(Environment).filter_by(hash="e" * 64).one_or_none()
    if env is None:
        env = Environment(
            hash="e" * 64,
            hosts=["node-a"],
            gpus=[],
            torch="2.13.0+cpu",
            python="3.11.7",
            ray="2.60.0",
            git_sha="abc1234",
            git_dirty=False,
        )
        session.add(env)
        session.flush()
    run.status = status
    run.environment_id = env.id
    run.error = error
    fits = [length for length, outcome, _ in probes if outcome == ProbeOutcome.fit]
    measured = max(fits) if fits else run.seq_len  # a search's ranks measured its answer
    for rank, median in enumerate(medians):
        session.add(
            RankResultRow(
                run_id=run_id,
                rank=rank,
                seq_len=measured,
                **timing([median * 0.9, median, median * 1.1], measured, flops),
                peak_memory_bytes=peak + rank,
                backend="sdpa",
            )
        )
    for seq_len, outcome, probe_peak in probes:
        session.add(
            Probe(run_id=run_id, seq_len=seq_len, outcome=outcome, peak_memory_bytes=probe_peak)
        )
    session.commit()


def cluster_once_connected(get: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """GET /cluster once the API's Ray driver has joined and reported (a process of its own:
    seconds); fails with the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = get("/api/v1/cluster")
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return dict(r.json())
        time.sleep(0.2)
