"""Helpers for the dashboard and CLI tests: finished sweeps written straight through the ORM
(no Ray needed), and a live uvicorn serving the real app on a free port in a thread.

The numbers are synthetic (the sweep names say so); their shapes follow the seeds' experiments:
throughput vs length per kernel at one and two ranks, and maximum-length searches with probes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import FastAPI
from sqlalchemy.orm import Session

from service.core.config import Settings
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import upgrade
from service.db.models import (
    Environment,
    Probe,
    ProbeOutcome,
    RankResultRow,
    Run,
    RunStatus,
    Sweep,
    SweepKind,
)
from service.results.rows import BYTES_PER_ELEMENT

H100_BF16_PEAK = 989e12
CPU_FP32_FLOPS = 140e9  # SDPA flash forward on this machine kind (reference.md)
T0 = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Seeded:
    """Ids of what seed_sweeps wrote."""

    benchmark: int
    rerun: int
    maxlen: int
    failed_run: int
    ring_run: int


def _config(kernel: str, seq_len: int, world_size: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kernel": kernel,
        "params": {},
        "seq_len": seq_len,
        "batch_size": 1,
        "num_heads": 8,
        "head_dim": 64,
        "dtype": "bfloat16",
        "causal": False,
        "mode": "forward",
        "world_size": world_size,
        "parallel": "sequence",
        "device": "auto",
        "warmup": 2,
        "iterations": 5,
        "timeout_s": 600.0,
        "max_attempts": 1,
        "placement": "pack",
    }
    cfg.update(extra)
    return cfg


def _run(sweep: Sweep, cfg: dict[str, Any], status: RunStatus, env: Environment | None) -> Run:
    run = Run(
        cell_key=f"cell-{len(sweep.runs)}",
        config=cfg,
        kernel=cfg["kernel"],
        seq_len=cfg["seq_len"],
        world_size=cfg["world_size"],
        dtype=cfg["dtype"],
        mode=cfg["mode"],
        causal=cfg["causal"],
        status=status,
        attempts=1,
        created_at=sweep.created_at,
        started_at=sweep.created_at + timedelta(seconds=5),
        finished_at=sweep.created_at + timedelta(seconds=30),
        environment=env,
    )
    sweep.runs.append(run)
    return run


def _ranks(run: Run, cfg: dict[str, Any], flops_total: float, rate: float, mem_factor: float):
    """Per-rank results for a run that does `flops_total` at `rate` FLOP/s per rank."""
    w = cfg["world_size"]
    h, d, bpe = cfg["num_heads"], cfg["head_dim"], BYTES_PER_ELEMENT[cfg["dtype"]]
    local = cfg["batch_size"] * cfg["seq_len"] // w
    floor = (4 * h * d * bpe + 4 * h) * local
    for rank in range(w):
        median = flops_total / w / rate * (1 + 0.03 * rank)
        # 7 iterations: their range is the median's interval at 98.4% (a change can be told)
        times = [median * f for f in (0.97, 0.98, 0.99, 1.0, 1.02, 1.04, 1.05)]
        run.rank_results.append(
            RankResultRow(
                rank=rank,
                seq_len=cfg["seq_len"],
                times_s=times,
                median_s=median,
                p10_s=times[0],
                p90_s=times[-1],
                tokens_per_s=local / median,
                flops=flops_total / w,
                flops_per_s=flops_total / w / median,
                peak_memory_bytes=int(floor * mem_factor) + 4 * 2**20,
                memory_budget_bytes=None,
                backend="flash",
                max_abs_error=None,
            )
        )


def _attn_flops(cfg: dict[str, Any], density: float = 1.0) -> float:
    s = cfg["seq_len"]
    return 4.0 * cfg["batch_size"] * s * s * cfg["num_heads"] * cfg["head_dim"] * density


def _env(hash_: str, gpus: list[dict[str, Any]]) -> Environment:
    return Environment(
        hash=hash_,
        hosts=["node-a"],
        gpus=gpus,
        driver="560.35" if gpus else None,
        cuda="12.6" if gpus else None,
        torch="2.13.0",
        nccl="2.23.4" if gpus else None,
        ray="2.60.0",
        python="3.11.9",
        git_sha="0123456789abcdef0123456789abcdef01234567",
        git_dirty=False,
        cpu_threads=16 if gpus else 2,
    )


def _benchmark(session: Session, name: str, created: datetime, slow: float) -> Sweep:
    """Kernels x lengths at W=1 and W=2 on H100s; `slow` scales ring's throughput (a rerun)."""
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_520_809_984}
    env = session.query(Environment).filter_by(hash="e-h100").one_or_none()
    env = env or _env("e-h100", [h100, {**h100, "uuid": "GPU-2"}])
    sweep = Sweep(name=name, kind=SweepKind.benchmark, spec={"name": name}, created_at=created)
    session.add(sweep)
    dilated = {"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]}
    for s in (2048, 4096, 8192, 16384):
        eff = 0.55 * s / (s + 4096)
        cases = [
            (_config("dense", s, 1), 1.0, eff),
            (_config("dense", s, 2, parallel="data", batch_size=2), 1.0, eff * 0.97),
            (_config("ring", s, 2, params={"layout": "contiguous"}), 1.0, eff * 0.85 * slow),
            (_config("dilated", s, 1, params=dilated), 0.375, eff * 0.6),
        ]
        for cfg, density, e in cases:
            run = _run(sweep, cfg, RunStatus.succeeded, env)
            _ranks(run, cfg, _attn_flops(cfg, density), e * H100_BF16_PEAK, 1.3)
    cfg = _config("ring", 32768, 2, params={"layout": "contiguous"})
    failed = _run(sweep, cfg, RunStatus.failed if slow != 1.0 else RunStatus.succeeded, env)
    if slow != 1.0:
        failed.error = (  # with the quotes of an attribute injection (it must stay text)
            "RankFailed: rank 1: RuntimeError: gloo timeout after 120 s; "
            'peer said " autofocus onfocus="window.__xss=1" x="'
        )
    else:
        _ranks(failed, cfg, _attn_flops(cfg), 0.4 * H100_BF16_PEAK, 1.3)
    return sweep


def _maxlen(session: Session, created: datetime) -> Sweep:
    """Maximum length per kernel x world size on CPU with an emulated 64 MiB budget."""
    env = _env("e-cpu", [])
    name = "max length per kernel (synthetic numbers)"
    sweep = Sweep(name=name, kind=SweepKind.max_seq_len, spec={"name": name}, created_at=created)
    session.add(sweep)
    budget = 64 * 2**20
    bs = {"block_size": 256, "pattern": "local_window", "sparsity_ratio": 0.25}
    cases = [
        (_config("dense", 1024, 1, dtype="float32"), 40_000),
        (_config("block_sparse", 1024, 1, dtype="float32", params=bs), 30_000),
        (_config("ring", 1024, 2, dtype="float32"), 22_000),
        (_config("dense", 1024, 2, dtype="float32", parallel="data", batch_size=2), 40_000),
    ]
    for cfg, bytes_per_token in cases:
        cfg = {**cfg, "memory_budget_bytes": budget}
        cfg["search"] = {"start": 1024, "max": 65536, "granularity": 256}
        run = _run(sweep, cfg, RunStatus.succeeded, env)
        local_per_token = bytes_per_token / (
            cfg["world_size"] if cfg["parallel"] == "sequence" else 1
        )
        s, fit = 1024, []
        while True:  # doubling, then one bisection step: the probes a search leaves
            peak = int(s * local_per_token)
            ok = peak <= budget
            run.probes.append(
                Probe(
                    seq_len=s,
                    outcome=ProbeOutcome.fit if ok else ProbeOutcome.oom,
                    peak_memory_bytes=peak if ok else None,
                    time_s=s * s * 64 * 8 * 4 / CPU_FP32_FLOPS if ok else None,
                    error=None if ok else f"peak {peak} B over the {budget} B budget",
                    emulated=not ok,
                )
            )
            if not ok:
                break
            fit.append(s)
            s *= 2
        mid = (fit[-1] + s) // 2
        peak = int(mid * local_per_token)
        run.probes.append(
            Probe(
                seq_len=mid,
                outcome=ProbeOutcome.fit if peak <= budget else ProbeOutcome.oom,
                peak_memory_bytes=peak if peak <= budget else None,
                time_s=None,
                error=None,
                emulated=peak > budget,
            )
        )
        # The ranks' measurement is the one at the answer, as the search leaves it.
        answer = {**cfg, "seq_len": max(p.seq_len for p in run.probes if p.outcome == "fit")}
        _ranks(run, answer, _attn_flops(answer), 0.5 * CPU_FP32_FLOPS, 3.0)
    return sweep


def seed_sweeps(database_url: str) -> Seeded:
    """Migrate the database and write three finished sweeps (benchmark, its rerun, max length)."""
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            a = _benchmark(session, "kernels on 2x H100 (synthetic numbers)", T0, 1.0)
            b = _benchmark(
                session, "rerun after a change (synthetic numbers)", T0 + timedelta(1), 0.8
            )
            m = _maxlen(session, T0 + timedelta(2))
            session.commit()
            failed = next(r.id for r in b.runs if r.status == RunStatus.failed)
            ring = next(r.id for r in a.runs if r.kernel == "ring")
            return Seeded(a.id, b.id, m.id, failed, ring)
    finally:
        engine.dispose()


def make_web_app(settings: Settings) -> FastAPI:
    """The service's app (API under /api/v1) with the dashboard mounted, no scheduler."""
    from service.app import create_app

    return create_app(settings, with_scheduler=False)


@contextmanager
def live_server(app: FastAPI, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on a free port; yield its base URL; stop it."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start within {timeout_s} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


def seed_running_sweep(database_url: str) -> tuple[int, list[int]]:
    """A sweep whose two runs are still queued (for the live-update test): (sweep id, run ids)."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            name = "live sweep (synthetic numbers)"
            sweep = Sweep(name=name, kind=SweepKind.benchmark, spec={"name": name}, created_at=T0)
            session.add(sweep)
            for s in (1024, 2048):
                _run(sweep, _config("dense", s, 1, dtype="float32"), RunStatus.queued, None)
            session.commit()
            return sweep.id, [r.id for r in sweep.runs]
    finally:
        engine.dispose()


def finish_run(database_url: str, run_id: int) -> None:
    """Mark a queued run succeeded with one rank's result, as the scheduler would."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.get(Run, run_id)
            assert run is not None
            run.status = RunStatus.succeeded
            run.environment = session.query(Environment).filter_by(hash="e-cpu").one_or_none()
            _ranks(run, run.config, _attn_flops(run.config), 0.5 * CPU_FP32_FLOPS, 3.0)
            session.commit()
    finally:
        engine.dispose()
