"""Goldens of everything a stored result becomes: results.json, results.csv, components.csv,
pivot.csv and report.md of one sweep per workload (benchmark, max_seq_len, model, ring steps),
compared byte for byte.

Each sweep is submitted through the API and every run is claimed and finished through the
scheduler's own write path (leases.claim_next, completion_from_outcome, write.finish) with
an outcome computed from the run's config alone, so the bytes depend on the code, never on the
machine or the clock. They guard the result path's refactors (issue 38: behaviour unchanged);
a change that means to alter what a researcher reads re-records them on purpose:

    RINGLAB_UPDATE_GOLDENS=1 .venv/bin/python -m pytest tests/service/test_result_goldens.py
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _results_helpers import timing
from sqlalchemy import update

from service import leases
from service.db.models import Run, Sweep
from service.results import write
from service.results.write import completion_from_outcome
from workers.config import RunConfig
from workers.results import (
    EnvironmentInfo,
    MemoryComponent,
    ProbeResult,
    RankResult,
    RunOutcome,
    StepTime,
    step_totals,
)

GOLDENS = Path(__file__).parent / "goldens"
UPDATE = os.environ.get("RINGLAB_UPDATE_GOLDENS") == "1"
API = "/api/v1"
T0 = datetime(2026, 1, 2, 3, 4, 5)
CPU = {"device": "cpu", "num_heads": 4, "head_dim": 32, "dtype": "float32"}
MODEL = {"name": "tiny", "d_model": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 4096}
SPECS: dict[str, dict[str, Any]] = {
    "benchmark": {
        "name": "golden benchmark",
        "base": {**CPU, "batch_size": 2, "iterations": 3},
        "grid": {"seq_len": [1024, 2048]},
        "zip": {
            "kernel": ["dense", "dense", "ring", "dilated"],
            "world_size": [1, 2, 2, 1],
            "parallel": ["sequence", "data", "sequence", "sequence"],
        },
        "analysis": {"baseline": {"kernel": "dense", "world_size": 1}},
    },
    "max_seq_len": {
        "name": "golden max_seq_len",
        "kind": "max_seq_len",
        "base": {**CPU, "memory_budget_bytes": 64 << 20},
        "grid": {"kernel": ["dense", "dilated"]},
        "search": {"start": 1024, "max": 65536, "granularity": 1024},
    },
    "model": {
        "name": "golden model",
        "base": {"workload": "model", "kernel": "dense", "device": "cpu", "model": MODEL},
        "grid": {"seq_len": [512, 1024]},
    },
    "ring_steps": {
        "name": "golden ring steps",
        "base": {**CPU, "kernel": "ring", "causal": True},
        "grid": {"seq_len": [1024, 2048], "world_size": [2, 4]},
    },
}
ENVIRONMENT = EnvironmentInfo(
    hosts=["node-a"],
    torch="2.13.0+cpu",
    python="3.11.7",
    ray="2.60.0",
    git_sha="abc1234",
    git_dirty=False,
    cpu_threads=1,
    cpu_model="Golden CPU @ 2.0GHz",
    cpu_cores=2,
    matmul_dtype="float32",
    matmul_size=1024,
    matmul_s=0.0625,
    matmul_flops_per_s=2 * 1024**3 / 0.0625,
)


def _rank(config: RunConfig, rank: int, seq_len: int) -> RankResult:
    """One rank's measurement: times grow as seq^1.5 and with the rank, memory with seq."""
    t = 1e-3 * (seq_len / 1024) ** 1.5 * (1 + 0.125 * rank) * (1 + 0.5 * (config.world_size - 1))
    local = seq_len * config.batch_size // config.world_size
    flops = 4.0 * seq_len * seq_len * config.num_heads * config.head_dim / config.world_size
    steps = _steps(config, rank) if config.kernel.startswith("ring") else []
    model = config.workload == "model"
    return RankResult(
        rank=rank,
        seq_len=seq_len,
        **timing([t * 0.96, t, t * 1.08], local, flops),
        peak_memory_bytes=2064 * seq_len + 4096 * rank,
        input_memory_bytes=1536 * seq_len,
        memory_budget_bytes=config.memory_budget_bytes,
        backend="flash",
        max_abs_error=1.5e-6,
        check_seq_len=min(seq_len, 1024),
        sampled_check_error=2.5e-6 if seq_len > 1024 else None,
        sampled_check_seq_len=seq_len if seq_len > 1024 else None,
        sampled_check_rows=97 if seq_len > 1024 else None,
        forward_s=t * 0.3 if model else None,
        backward_s=t * 0.6 if model else None,
        optimizer_s=t * 0.1 if model else None,
        predicted_max_seq_len=None,
        components=_components(seq_len) if model else [],
        steps=steps,
        **step_totals(steps),
        **(_link(config) if config.kernel.startswith("ring") else {}),
        **_compiling(config, rank),
    )


def _compiling(config: RunConfig, rank: int) -> dict[str, Any]:
    """What the rank compiled: dilated's cells stand in for a compiled kernel (two graphs,
    rank 1 the slower); every other cell compiled nothing."""
    if config.kernel != "dilated":
        return {"compilations": 0, "compile_s": 0.0}
    return {"compilations": 2, "compile_s": 12.5 + rank}


def _steps(config: RunConfig, rank: int) -> list[StepTime]:
    block = 2 * config.seq_len // config.world_size * config.num_heads * config.head_dim * 4
    return [
        StepTime(
            iteration=i,
            phase=phase,
            step=s,
            compute_s=1e-4 * (s + 1 + rank),
            wait_s=2e-5 * s,
            sent_bytes=block if s < config.world_size - 1 else 0,
            received_bytes=block if s > 0 else 0,
            transfer_window_bytes_per_s=2e9 if s > 0 else None,
        )
        for i in range(2)
        for phase in ("forward", "backward")
        for s in range(config.world_size)
    ]


def _link(config: RunConfig) -> dict[str, Any]:
    block = 2 * config.seq_len // config.world_size * config.num_heads * config.head_dim * 4
    return {"link_probe_bytes": block, "link_probe_bytes_per_s": 4e9, "link_latency_s": 2e-5}


def _components(seq_len: int) -> list[MemoryComponent]:
    fixed = {"parameters": 4 << 20, "gradients": 4 << 20, "optimizer_states": 8 << 20}
    sized = {"activations": 3000 * seq_len, "step_peak": (16 << 20) + 3500 * seq_len}
    return [
        MemoryComponent(component=name, predicted_bytes=value, measured_bytes=value + 1024)
        for name, value in {**fixed, **sized}.items()
    ]


def _outcome(config: RunConfig, kind: str) -> RunOutcome:
    """The run's outcome from its config alone: a search fits 1K and 2K and runs out at 4K."""
    if kind != "max_seq_len":
        ranks = [_rank(config, r, config.seq_len) for r in range(config.world_size)]
        return RunOutcome(status="succeeded", ranks=ranks, environment=ENVIRONMENT)
    probes = [
        ProbeResult(seq_len=n, outcome="fit", peak_memory_bytes=2064 * n, time_s=1e-3 * n / 1024)
        for n in (1024, 2048)
    ]
    probes.append(ProbeResult(seq_len=4096, outcome="oom", requested_bytes=96 << 20))
    return RunOutcome(
        status="succeeded",
        ranks=[_rank(config, 0, 2048)],
        probes=probes,
        environment=ENVIRONMENT,
        answer_seq_len=2048,
    )


def _store(client: Any, spec: dict[str, Any]) -> int:
    """Submit `spec`, then finish each of its runs through the scheduler's write path."""
    created = client.post(f"{API}/sweeps", json=spec)
    assert created.status_code == 201, created.text
    sweep_id = int(created.json()["id"])
    sm = client.app.state.sessionmaker
    while (claim := leases.claim_next(sm, "golden", 60.0)) is not None:
        outcome = _outcome(RunConfig.model_validate(claim.config), claim.kind)
        assert write.finish(sm, claim, completion_from_outcome(outcome))
    with sm() as session, session.begin():  # the clock's marks, fixed
        session.execute(update(Sweep).values(created_at=T0))
        for run in session.query(Run).order_by(Run.id):
            start = T0 + timedelta(seconds=10 * run.id)
            run.created_at, run.started_at = T0, start
            run.finished_at, run.heartbeat_at = start + timedelta(seconds=3), None
            run.lease_expires_at = None
    return sweep_id


@pytest.mark.parametrize("workload", list(SPECS))
def test_what_a_stored_sweep_becomes_is_unchanged(tmp_path: Path, workload: str) -> None:
    with api_client(f"sqlite:///{tmp_path / 'golden.db'}") as client:
        sweep_id = _store(client, SPECS[workload])
        for name in ("results.json", "results.csv", "components.csv", "pivot.csv", "report.md"):
            got = client.get(f"{API}/sweeps/{sweep_id}/{name}")
            assert got.status_code == 200, (name, got.text)
            path = GOLDENS / workload / name
            if UPDATE:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(got.content)
            assert path.exists(), f"no golden {path}: record it with RINGLAB_UPDATE_GOLDENS=1"
            assert got.content == path.read_bytes(), f"{workload}/{name} changed"
