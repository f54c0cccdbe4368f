"""Concurrent gangs: N one-rank cells on a local Ray that declares more CPUs than the machine has.

One scheduler (service.scheduler) drains a sweep of --cells one-rank dense CPU runs on a fresh
local Ray started with --num-cpus logical CPUs, on a fresh SQLite file. It prints how many runs
were in flight at once (from the runs' own started_at / finished_at, claim to commit), the
co-tenants each run recorded, and the sweep's wall time against the sum of its runs' times
(issue 42's target: at least 4 at once, wall <= 0.5 x sum, for 8 cells at 8 CPUs).

    .venv/bin/python -m bench.concurrency [--cells 8] [--num-cpus 8] [--iterations 300]

(-m from the repository root: run as a file, bench/service.py would shadow the package.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import ray

from bench.scheduler import enqueue
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import upgrade
from service.db.models import TERMINAL_STATUSES, Run
from service.scheduler import Scheduler
from workers.config import RunConfig
from workers.gang import GangPool


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=8, help="one-rank runs in the sweep")
    ap.add_argument("--num-cpus", type=int, default=8, help="CPUs the local Ray declares")
    ap.add_argument("--iterations", type=int, default=300, help="timed iterations per run")
    ap.add_argument("--seq-len", type=int, default=512)
    return ap.parse_args()


def peak_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most runs whose [started, finished] spans overlap at one instant."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


def drain(sched: Scheduler, sm: object, timeout_s: float) -> list[Run]:
    """Run the scheduler in a thread until every run is terminal; the runs, by id."""
    stop = threading.Event()
    thread = threading.Thread(target=sched.run_forever, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with sm() as session:  # type: ignore[operator]
                runs = session.query(Run).order_by(Run.id).all()
            if runs and all(r.status in TERMINAL_STATUSES for r in runs):
                return runs
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs not done in {timeout_s:.0f} s")
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(60)


def main() -> None:
    args = parse()
    cell = {"kernel": "dense", "seq_len": args.seq_len, "num_heads": 2, "head_dim": 16,
            "warmup": 1, "iterations": args.iterations, "device": "cpu",
            "correctness_check": False}  # fmt: skip
    print(
        f"setup: {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), local Ray "
        f"declaring {args.num_cpus} CPUs, SQLite; {args.cells} one-rank dense CPU runs "
        f"(seq {args.seq_len}, {args.iterations} iterations, gate off)"
    )
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        upgrade(url)
        sm = make_sessionmaker(make_engine(url))
        enqueue(sm, [RunConfig.model_validate({**cell, "seed": i}) for i in range(args.cells)])
        pool = GangPool(placement_timeout_s=300)
        sched = Scheduler(sm, pool=pool, lease_s=30.0, heartbeat_s=1.0, poll_s=0.05)
        try:
            runs = drain(sched, sm, 1800)
        finally:
            pool.close()
            ray.shutdown()
    statuses = sorted({str(r.status) for r in runs})
    spans = [(r.started_at.timestamp(), r.finished_at.timestamp()) for r in runs]
    total = sum(e - s for s, e in spans)
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    print(f"statuses: {statuses}")
    print(f"in flight at once (claim to commit): {peak_in_flight(spans)} of {len(runs)}")
    print(f"co-tenants per run: {[len(r.cotenants or []) for r in runs]}")
    print(
        f"sum of run times {total:.1f} s, sweep wall {wall:.1f} s, wall / sum {wall / total:.2f}"
        " (target <= 0.5)"
    )


if __name__ == "__main__":
    main()
