"""Helpers for the scheduler tests: tiny sweeps inserted with the ORM, and an in-process executor.

The in-process executor implements the pool/handle contract of workers.gang (start, poll, kill)
over a thread, so the database half (claims, leases, recovery, writes) is tested without Ray.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import (
    DEFAULT_SUBMITTER,
    RankResultRow,
    Run,
    RunStatus,
    Sweep,
    SweepKind,
    run_config_columns,
    utcnow,
)
from workers.config import RunConfig
from workers.errors import Infeasible, RankFailed
from workers.results import EnvironmentInfo, ProbeResult, RunOutcome
from workers.results import RankResult as RankMeasure

TINY = {
    "kernel": "dense",
    "seq_len": 64,
    "num_heads": 2,
    "head_dim": 16,
    "warmup": 1,
    "iterations": 2,
    "device": "cpu",
}


def tiny_config(**overrides: Any) -> RunConfig:
    """A dense CPU run small enough for seconds-long tests."""
    return RunConfig.model_validate({**TINY, **overrides})


def add_sweep(
    sm: sessionmaker[Session],
    configs: list[RunConfig],
    kind: SweepKind = SweepKind.benchmark,
    name: str = "t",
    submitter: str = DEFAULT_SUBMITTER,
) -> list[int]:
    """Insert one sweep with a queued run per config; their ids in order."""
    with sm() as session, session.begin():
        sweep = Sweep(name=name, kind=kind, spec={"name": name}, submitter=submitter)
        session.add(sweep)
        runs = [
            Run(
                sweep=sweep,
                cell_key=f"cell-{i}",
                config=c.model_dump(mode="json"),
                **run_config_columns(c),
                status=RunStatus.queued,
                attempts=0,
            )
            for i, c in enumerate(configs)
        ]
        session.add_all(runs)
        session.flush()
        return [r.id for r in runs]


def run_row(sm: sessionmaker[Session], run_id: int) -> Run:
    with sm() as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run


@contextmanager
def migrated_sqlite(path: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on a SQLite file at `path` migrated to head (the tests that need one backend
    only); the engine is disposed afterwards."""
    from service.db.engine import make_engine, make_sessionmaker
    from service.db.migrate import upgrade

    url = f"sqlite:///{path}"
    upgrade(url)
    engine = make_engine(url)
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


def cancel_as_api(sm: sessionmaker[Session], run_id: int) -> None:
    """Cancel run `run_id` the way POST /sweeps/{id}/cancel does: status, finished_at, error."""
    with sm() as session, session.begin():
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(status=RunStatus.cancelled, finished_at=utcnow(), error="cancelled by request")
        )


@contextmanager
def succeeded_run(sm: sessionmaker[Session], run_id: int) -> Iterator[tuple[Session, Run]]:
    """An open session and run `run_id` in it, asserted succeeded without an error (the session
    stays open so that its rank results and probes load)."""
    with sm() as session:
        run = session.get(Run, run_id)
        assert run is not None
        assert (run.status, run.error) == (RunStatus.succeeded, None)
        yield session, run


def rank_rows_per_run(sm: sessionmaker[Session]) -> Counter[int]:
    with sm() as session:
        rows = session.execute(
            select(RankResultRow.run_id, func.count()).group_by(RankResultRow.run_id)
        )
        return Counter({run_id: n for run_id, n in rows})


def fake_outcome(config: RunConfig, host: str = "testhost") -> RunOutcome:
    """A succeeded outcome with one plausible measurement per rank."""
    ranks = [
        RankMeasure(
            rank=r,
            seq_len=config.seq_len,
            times_s=[0.01, 0.011],
            median_s=0.0105,
            p10_s=0.01,
            p90_s=0.011,
            tokens_per_s=config.local_seq_len / 0.0105,
            flops=1e6,
            flops_per_s=1e6 / 0.0105,
            peak_memory_bytes=4096,
            backend="fake",
        )
        for r in range(config.world_size)
    ]
    env = EnvironmentInfo(hosts=[host], torch="2.x", python="3.x")
    return RunOutcome(status="succeeded", ranks=ranks, environment=env)


@dataclass
class Script:
    """What the in-process executor does with one run: sleep, then succeed, fail or hang."""

    delay_s: float = 0.05
    fail_attempts: int = 0  # the first N starts raise RankFailed
    hang: bool = False
    waiting_s: float = 0.0  # bundles not ready for this long (on_waiting, empty placement)
    infeasible: tuple[str, str] | None = None  # (needed, available): start raises Infeasible
    probes: tuple[ProbeResult, ...] = ()  # a max_seq_len search's probes ended before it hangs
    start_s: float = 0.0  # start() takes this long before fits() sees the run (placement)


@dataclass
class ThreadPool:
    """start/poll/kill over a thread per run; records starts and kills per run (by cell seq)."""

    script_for: Callable[[RunConfig], Script] = lambda _c: Script()
    starts: Counter[int] = field(default_factory=Counter)
    kills: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slots: int = 1  # runs fits() admits at once (1: one at a time, as a one-slot cluster)
    live: list[ThreadHandle] = field(default_factory=list)

    def fits(self, config: RunConfig) -> bool:
        with self.lock:
            self.live = [h for h in self.live if not (h.done.is_set() or h.killed.is_set())]
            return len(self.live) < self.slots

    def start(
        self, config: RunConfig, kind: str, *, on_waiting: Callable[..., None] | None = None
    ) -> ThreadHandle:
        script = self.script_for(config)
        if script.infeasible is not None:
            raise Infeasible(*script.infeasible)
        with self.lock:
            self.starts[config.seed] += 1
            n = self.starts[config.seed]
        if script.waiting_s and on_waiting is not None:
            on_waiting()  # like GangPool: synchronously, when the bundles are not ready at once
        time.sleep(script.start_s)  # GangPool: the placement group enters Ray's table here
        handle = ThreadHandle(self, config, script, n)
        with self.lock:
            self.live.append(handle)
        return handle

    def close(self) -> None:
        pass


class ThreadHandle:
    """One run on a thread: its result (or error) lands in an event the poll waits on."""

    def __init__(
        self,
        pool: ThreadPool,
        config: RunConfig,
        script: Script,
        start_no: int,
    ) -> None:
        self.pool = pool
        self.placed: list[str] = []
        self.ended_probes: list[ProbeResult] = []
        self.done = threading.Event()
        self.killed = threading.Event()
        self.result: RunOutcome | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(
            target=self._work, args=(config, script, start_no), daemon=True
        )
        self.thread.start()

    def _work(
        self,
        config: RunConfig,
        script: Script,
        start_no: int,
    ) -> None:
        if self.killed.wait(script.waiting_s):
            return
        self.placed = [f"rank {r}" for r in range(config.world_size)]
        self.ended_probes = list(script.probes)
        if self.killed.wait(script.delay_s) or script.hang:
            return
        if start_no <= script.fail_attempts:
            self.error = RankFailed(1, f"simulated death on start {start_no}")
        else:
            self.result = fake_outcome(config)
        self.done.set()

    def poll(self, timeout_s: float) -> RunOutcome | None:
        if not self.done.wait(timeout_s):
            return None
        if self.error is not None:
            raise self.error
        return self.result

    def placement(self) -> list[str]:
        return list(self.placed)

    def probes(self) -> list[ProbeResult]:
        return list(self.ended_probes)

    def kill(self, reason: str) -> None:
        if not self.killed.is_set():
            self.killed.set()
            with self.pool.lock:
                self.pool.kills.append(reason)


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll pred until true; fail naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def long_config(**overrides: Any) -> RunConfig:
    """A W=2 CPU run of many tiny iterations (~0.3 ms each here): alive long enough to act on."""
    return tiny_config(
        **{"seq_len": 256, "world_size": 2, "parallel": "data", "batch_size": 2, **overrides}
    )


@dataclass
class RecordingPool:
    """A real workers.gang.GangPool that keeps the handles it returned (to find rank pids)."""

    pool: Any
    handles: list[Any] = field(default_factory=list)

    def start(
        self, config: RunConfig, kind: str, *, on_waiting: Callable[[], None] | None = None
    ) -> Any:
        handle = self.pool.start(config, kind, on_waiting=on_waiting)
        self.handles.append(handle)
        return handle


def live_placement_groups() -> set[str]:
    """Ids of the placement groups Ray has not removed."""
    from ray.util import placement_group_table

    return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


def scheduler_main(database_url: str, ray_address: str, lease_s: float) -> None:
    """A scheduler process on a real GangPool, until killed (the crash test kills it with -9)."""
    import logging

    from service.db.engine import make_engine, make_sessionmaker
    from service.scheduler import Scheduler
    from workers import cluster
    from workers.gang import GangPool

    logging.basicConfig(level=logging.INFO)
    cluster.connect(ray_address)
    sched = Scheduler(
        make_sessionmaker(make_engine(database_url)),
        pool=GangPool(),
        lease_s=lease_s,
        heartbeat_s=lease_s / 4,
        poll_s=0.05,
        max_concurrent=1,  # the crash test kills it while exactly one run is in flight
    )
    sched.run_forever(threading.Event())
