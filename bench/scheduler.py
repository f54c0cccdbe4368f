"""Scheduler overhead per run on a warm gang, and the cold start of a gang (CPU, gloo ranks).

Overhead of one run = (first timed iteration began - claim began) + (result committed - last
timed iteration ended); the iteration timestamps come from the ranks (RunOutcome
first_iteration_at / last_iteration_at, the same machine's clock), the claim and commit marks
from the scheduler (Scheduler.last_trace). warmup defaults to 0 so no protocol time is counted.

    .venv/bin/python -m bench.scheduler [--runs 20] [--cold 3] [--database-url URL]

(-m from the repository root: run as a file, bench/service.py would shadow the package.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from bench.service import fresh_schema
from service.core.config import normalize_database_url
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import upgrade
from service.db.models import Run, RunStatus, Sweep, SweepKind
from service.scheduler import RunTrace, Scheduler
from workers.config import RunConfig
from workers.gang import GangPool


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="warm runs measured (>= 10)")
    ap.add_argument("--cold", type=int, default=3, help="runs on fresh gangs (cold starts)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    args = ap.parse_args()
    if args.runs < 10:
        ap.error("--runs: need at least 10 for a median")
    return args


def config(args: argparse.Namespace, seed: int, fresh: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "kernel": "dense",
            "seq_len": args.seq_len,
            "num_heads": 2,
            "head_dim": 16,
            "batch_size": args.world_size,
            "world_size": args.world_size,
            "parallel": "data",
            "device": "cpu",
            "warmup": args.warmup,
            "iterations": args.iterations,
            "fresh_processes": fresh,
            "seed": seed,
        }
    )


@dataclass(frozen=True)
class Marks:
    """One run's timestamps (time.time()): scheduler marks and the ranks' iteration marks."""

    claim_started: float
    claimed: float
    first_iteration: float
    last_iteration: float
    outcome: float
    committed: float
    gang_start_s: float | None

    @classmethod
    def of(cls, t: RunTrace) -> Marks:
        o = t.outcome
        if (
            o is None
            or o.first_iteration_at is None
            or o.last_iteration_at is None
            or t.outcome_at is None
            or t.committed_at is None
        ):
            raise RuntimeError(f"run {t.run_id}: a timestamp is missing: {t}")
        return cls(
            t.claim_started_at,
            t.claimed_at,
            o.first_iteration_at,
            o.last_iteration_at,
            t.outcome_at,
            t.committed_at,
            o.gang_start_s,
        )


def enqueue(sm: Any, configs: list[RunConfig]) -> None:
    with sm() as session, session.begin():
        sweep = Sweep(name="bench-scheduler", kind=SweepKind.benchmark, spec={})
        session.add(sweep)
        for i, c in enumerate(configs):
            session.add(
                Run(
                    sweep=sweep,
                    cell_key=f"bench-{i}",
                    config=c.model_dump(mode="json"),
                    kernel=c.kernel,
                    seq_len=c.seq_len,
                    world_size=c.world_size,
                    dtype=c.dtype,
                    mode=c.mode,
                    causal=c.causal,
                )
            )


def run_all(sched: Scheduler, n: int) -> list[Marks]:
    traces = []
    for _ in range(n):
        if not sched.run_once():
            raise RuntimeError("queue empty before all runs ran")
        trace = sched.last_trace
        if trace is None or trace.status != RunStatus.succeeded:
            raise RuntimeError(f"run did not succeed: {trace}")
        traces.append(Marks.of(trace))
    return traces


def ms(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10) if len(values) >= 2 else [values[0]] * 9
    med = statistics.median(values)
    return f"median {med * 1e3:7.1f} ms  p10 {q[0] * 1e3:7.1f}  p90 {q[-1] * 1e3:7.1f}"


def main() -> None:
    args = parse()
    tmp = tempfile.TemporaryDirectory()
    base = normalize_database_url(args.database_url or f"sqlite:///{tmp.name}/bench.db")
    with own_schema(base) as url:
        measure(args, url)
    tmp.cleanup()


@contextlib.contextmanager
def own_schema(url: str) -> Iterator[str]:
    """Postgres: a schema of our own (search_path), dropped at the end; SQLite: the file."""
    if not url.startswith("postgresql"):
        yield url
        return
    with fresh_schema(url) as scoped:
        yield scoped


def measure(args: argparse.Namespace, url: str) -> None:
    """Run the cold and warm runs through a real Scheduler and GangPool; print the numbers."""
    upgrade(url)
    engine = make_engine(url)
    sm = make_sessionmaker(engine)
    # address="local": always a fresh local Ray, never a cluster someone else started here.
    ray.init(
        address="local",
        num_cpus=max(2, args.world_size),
        include_dashboard=False,
        log_to_driver=False,
    )
    pool = GangPool()
    try:
        sched = Scheduler(sm, pool=pool, lease_s=30.0, heartbeat_s=5.0, poll_s=0.5)
        # Cold: every run on fresh processes (placement group + actors + process group).
        enqueue(sm, [config(args, i, fresh=True) for i in range(args.cold)])
        cold = run_all(sched, args.cold)
        # Warm: one run to bring the gang up, then the measured runs on it.
        enqueue(sm, [config(args, 1000 + i, fresh=False) for i in range(args.runs + 1)])
        warm = run_all(sched, args.runs + 1)[1:]
    finally:
        pool.close()
        ray.shutdown()
        engine.dispose()
    if any(t.gang_start_s is not None for t in warm):
        raise RuntimeError("a measured warm run started a gang: the pool did not reuse it")

    pre = [t.first_iteration - t.claim_started for t in warm]
    post = [t.committed - t.last_iteration for t in warm]
    total = [a + b for a, b in zip(pre, post, strict=True)]
    claim = [t.claimed - t.claim_started for t in warm]
    start_to_first = [t.first_iteration - t.claimed for t in warm]
    last_to_poll = [t.outcome - t.last_iteration for t in warm]
    write = [t.committed - t.outcome for t in warm]

    backend = url.split(":", 1)[0]  # no credentials printed
    print("bench/scheduler.py: scheduler overhead per run, CPU gloo ranks")
    print(
        f"setup: W={args.world_size} parallel=data kernel=dense seq_len={args.seq_len} heads=2 "
        f"head_dim=16 float32 warmup={args.warmup} iterations={args.iterations}; database "
        f"{backend}; ray.init(num_cpus={max(2, args.world_size)}); {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}, ray "
        f"{ray.__version__}"
    )
    print(f"warm gang, {len(warm)} runs:")
    print(f"  overhead (claim->first timed iter + last iter->committed): {ms(total)}")
    print(f"    claim (one transaction)                  {ms(claim)}")
    print(f"    claimed -> first timed iteration (engine) {ms(start_to_first)}")
    print(f"    last iteration -> poll returns (engine)   {ms(last_to_poll)}")
    print(f"    poll returned -> results committed (DB)   {ms(write)}")
    gang = [t.gang_start_s for t in cold if t.gang_start_s is not None]
    if len(gang) != len(cold):
        raise RuntimeError("a fresh-process run reported no gang start")
    cold_first = [t.first_iteration - t.claim_started for t in cold]
    print(f"cold start, {len(cold)} fresh gangs (placement group + actors + process group):")
    each = ", ".join(f"{g:.2f}" for g in gang)
    print(f"  gang start: {each} s (median {statistics.median(gang):.2f} s)")
    print(f"  claim -> first timed iteration: median {statistics.median(cold_first):.2f} s")


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"(bench took {time.monotonic() - t0:.0f} s)")
