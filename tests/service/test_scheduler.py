"""The scheduler's database half on SQLite and Postgres: claims, leases, recovery, writes.

Runs execute on the in-process executor of tests/_scheduler_helpers.py (no Ray); the Ray half is
in tests/service/test_scheduler_ray.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from _scheduler_helpers import (
    Script,
    ThreadPool,
    add_sweep,
    cancel_as_api,
    fake_outcome,
    rank_rows_per_run,
    run_row,
    tiny_config,
    wait_for,
)
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.exc import IntegrityError

from service import leases
from service.db.engine import make_sessionmaker
from service.db.models import (
    Environment,
    Probe,
    RankResultRow,
    Run,
    RunStatus,
    SweepKind,
    utcnow,
)
from service.results import write
from service.results.write import Completion, completion_from_outcome
from service.scheduler import Scheduler
from workers.results import ProbeResult

pytestmark = pytest.mark.timeout(60)

# A claiming process: claims (and heartbeats) until nothing is queued, prints the ids it got.
CLAIM_LOOP = """
import json, os, sys
from service import leases
from service.db.engine import make_engine, make_sessionmaker
sm = make_sessionmaker(make_engine(sys.argv[1]))
got = []
while (claim := leases.claim_next(sm, f"proc-{os.getpid()}", 30)) is not None:
    got.append(claim.run_id)
    if not leases.heartbeat(sm, claim, 30):
        raise SystemExit(f"lost the lease of run {claim.run_id} right after claiming it")
print(json.dumps(got))
"""


def make_scheduler(engine: Engine, pool: ThreadPool, **kwargs: object) -> Scheduler:
    opts: dict[str, object] = {"lease_s": 2.0, "heartbeat_s": 0.1, "poll_s": 0.02}
    opts.update(kwargs)
    return Scheduler(make_sessionmaker(engine), pool=pool, **opts)  # type: ignore[arg-type]


def test_claims_are_exclusive_under_concurrency(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    ids = add_sweep(sm, [tiny_config(seed=i) for i in range(40)])
    claimed: list[int] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        while (claim := leases.claim_next(sm, f"w{n}", lease_s=30)) is not None:
            with lock:
                claimed.append(claim.run_id)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == ids, "each run claimed exactly once"
    with sm() as session:
        rows = session.execute(select(Run.status, Run.attempts, Run.lease_owner)).all()
    assert {(r.status, r.attempts) for r in rows} == {(RunStatus.running, 1)}
    assert len({r.lease_owner for r in rows}) == len(ids), "one lease token per claim"


def test_claims_are_exclusive_across_processes(database_url: str, engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    ids = add_sweep(sm, [tiny_config(seed=i) for i in range(60)])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIM_LOOP, database_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    claimed: list[int] = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        claimed.extend(json.loads(out))
    assert sorted(claimed) == ids, "each run claimed exactly once, no database error"


def test_several_schedulers_run_every_run_exactly_once(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    configs = [tiny_config(seed=i, world_size=2, parallel="data", batch_size=2) for i in range(12)]
    ids = add_sweep(sm, configs)
    pool = ThreadPool(script_for=lambda _c: Script(delay_s=0.02))
    stop = threading.Event()
    schedulers = [make_scheduler(engine, pool) for _ in range(3)]
    threads = [threading.Thread(target=s.run_forever, args=(stop,)) for s in schedulers]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: all(run_row(sm, i).status == RunStatus.succeeded for i in ids),
            what="all runs succeeded",
        )
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert pool.starts == Counter({i: 1 for i in range(12)}), "no run started twice"
    assert rank_rows_per_run(sm) == Counter(dict.fromkeys(ids, 2))
    with sm() as session:
        assert session.scalar(select(func.count()).select_from(Environment)) == 1, "deduplicated"
        envs = set(session.scalars(select(Run.environment_id)))
    assert len(envs) == 1 and None not in envs


def test_run_once_false_when_nothing_queued(engine: Engine) -> None:
    assert make_scheduler(engine, ThreadPool()).run_once() is False


def test_expired_lease_is_recovered_to_queued(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    # 0.5 s: long enough that the claim's own commit (a round-robin claim writes the sweep
    # too) cannot outlast it on a loaded machine, short enough to wait out
    claim = leases.claim_next(sm, "crashed", lease_s=0.5)
    assert claim is not None
    assert leases.recover_expired(sm) == [], "a live lease is not recovered"
    time.sleep(0.6)
    assert make_scheduler(engine, ThreadPool()).recover() == [run_id]
    run = run_row(sm, run_id)
    assert (run.status, run.attempts, run.lease_owner) == (RunStatus.queued, 1, None)
    assert "lease" in (run.error or "")
    assert not leases.heartbeat(sm, claim, 30), "the crashed owner cannot renew"
    assert not write.finish(sm, claim, completion_from_outcome(fake_outcome(tiny_config())))
    assert rank_rows_per_run(sm) == Counter()


def test_runs_of_a_dead_scheduler_on_this_host_are_requeued_at_once(engine: Engine) -> None:
    """Restarted after a kill -9, a scheduler requeues what its dead predecessor on this host
    held without waiting 30 s for the lease: a dead pid, or its own pid under another
    instance (a restarted container), once the heartbeat is 1.5 periods late. Live processes,
    fresh heartbeats and other hosts keep their runs."""
    sm = make_sessionmaker(engine)
    ids = add_sweep(sm, [tiny_config(seed=i) for i in range(5)])
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owners = {
        ids[0]: f"{host}:{dead.pid}:aaaaaa",  # killed
        ids[1]: f"{host}:{os.getpid()}:bbbbbb",  # this pid, an earlier instance
        ids[2]: f"{host}:{os.getppid()}:cccccc",  # alive
        ids[3]: f"elsewhere:{dead.pid}:dddddd",  # another host: its pid means nothing here
        ids[4]: "named-scheduler",  # an owner given by name
    }
    claims = {}
    for _ in ids:
        claim = leases.claim_next(sm, "placeholder", lease_s=300)
        assert claim is not None
        token = leases.new_token(owners[claim.run_id])
        with sm() as session, session.begin():
            session.execute(update(Run).where(Run.id == claim.run_id).values(lease_owner=token))
        claims[claim.run_id] = token
    me = f"{host}:{os.getpid()}:mine00"
    scheduler = make_scheduler(engine, ThreadPool(), owner=me, lease_s=300, heartbeat_s=1.0)
    assert scheduler.recover() == [], "heartbeats still fresh: maybe alive, left alone"
    with sm() as session, session.begin():  # every heartbeat stopped 2 periods ago
        silent = utcnow() - timedelta(seconds=2.0)
        session.execute(update(Run).where(Run.id.in_(ids)).values(heartbeat_at=silent))
    assert scheduler.recover() == [ids[0], ids[1]]
    statuses = {i: run_row(sm, i).status for i in ids}
    assert statuses == {**dict.fromkeys(ids, RunStatus.running), ids[0]: RunStatus.queued,
                        ids[1]: RunStatus.queued}  # fmt: skip
    assert "scheduler running it on this host had died" in (run_row(sm, ids[0]).error or "")
    assert run_row(sm, ids[0]).attempts == 1, "the attempt it was on is not lost"
    assert scheduler.recover() == [], "each run is requeued once"


def test_a_run_whose_scheduler_keeps_dying_fails_instead_of_looping(engine: Engine) -> None:
    """Recovery requeues a run whose lease expired; after max_attempts + MAX_LOST_LEASES
    claims the next claim fails it, naming why, instead of running it once more."""
    from service.scheduler import MAX_LOST_LEASES

    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config(max_attempts=1)])
    for _ in range(1 + MAX_LOST_LEASES):  # each claim's scheduler "dies": the lease expires
        assert leases.claim_next(sm, "crashing", lease_s=0.01) is not None
        time.sleep(0.03)
        assert leases.recover_expired(sm) == [run_id]
    pool = ThreadPool()
    assert make_scheduler(engine, pool).run_once()
    run = run_row(sm, run_id)
    assert run.status == RunStatus.failed and pool.starts == Counter()
    assert f"died (lease expired) {MAX_LOST_LEASES + 1} times" in (run.error or "")


def test_finish_writes_once_and_only_with_the_lease(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config(world_size=2, parallel="data", batch_size=2)])
    claim = leases.claim_next(sm, "me", lease_s=30)
    assert claim is not None
    done = completion_from_outcome(
        fake_outcome(tiny_config(world_size=2, parallel="data", batch_size=2))
    )
    assert write.finish(sm, claim, done)
    assert not write.finish(sm, claim, done), "a second write is refused"
    assert rank_rows_per_run(sm) == Counter({run_id: 2})
    run = run_row(sm, run_id)
    assert run.status == RunStatus.succeeded and run.finished_at is not None
    assert run.lease_expires_at is None


def test_results_are_committed_in_one_transaction(engine: Engine) -> None:
    # A result row that violates a constraint rolls back the status change too.
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    claim = leases.claim_next(sm, "me", lease_s=30)
    assert claim is not None
    rank = fake_outcome(tiny_config()).ranks[0]
    with pytest.raises(IntegrityError):
        write.finish(sm, claim, Completion(RunStatus.succeeded, ranks=[rank, rank]))
    run = run_row(sm, run_id)
    assert run.status == RunStatus.running and rank_rows_per_run(sm) == Counter()


def test_cancel_while_running_kills_and_stays_cancelled(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(hang=True))
    sched = make_scheduler(engine, pool)
    worker = threading.Thread(target=sched.run_once)
    worker.start()
    wait_for(lambda: run_row(sm, run_id).status == RunStatus.running, what="running")
    cancel_as_api(sm, run_id)
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert pool.kills == ["run cancelled or lease lost"]
    run = run_row(sm, run_id)
    assert (run.status, run.error) == (RunStatus.cancelled, "cancelled by request")
    assert rank_rows_per_run(sm) == Counter()


def test_timeout_kills_and_records_timed_out(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config(timeout_s=0.3)])
    pool = ThreadPool(script_for=lambda _c: Script(hang=True))
    t0 = time.monotonic()
    assert make_scheduler(engine, pool).run_once()
    assert 0.3 <= time.monotonic() - t0 < 5
    run = run_row(sm, run_id)
    assert run.status == RunStatus.timed_out and "0.3 s" in (run.error or "")
    assert pool.kills == ["timeout after 0.3 s"]


def test_a_search_that_times_out_keeps_its_probes(engine: Engine) -> None:
    """The probes a max_seq_len search finished are stored with its timed_out status."""
    sm = make_sessionmaker(engine)
    search = {"start": 64, "max": 1024, "granularity": 64}
    (run_id,) = add_sweep(
        sm, [tiny_config(timeout_s=0.3, search=search)], kind=SweepKind.max_seq_len
    )
    ended = (
        ProbeResult(seq_len=64, outcome="fit", peak_memory_bytes=1000, time_s=0.01),
        ProbeResult(seq_len=128, outcome="oom", error="over budget", emulated=True),
    )
    pool = ThreadPool(script_for=lambda _c: Script(hang=True, probes=ended))
    assert make_scheduler(engine, pool).run_once()
    with sm() as session:
        run = session.get(Run, run_id)
        assert run is not None and run.status == RunStatus.timed_out
        stored = [(p.seq_len, p.outcome, p.peak_memory_bytes, p.emulated) for p in run.probes]
    assert stored == [(64, "fit", 1000, False), (128, "oom", None, True)]


def test_a_running_search_stores_its_probes_as_they_come(engine: Engine) -> None:
    """The dashboard and `ringlab watch` show a search's probes while it runs; the final write
    replaces them, so each is stored once; a new attempt starts without the old ones."""
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config(timeout_s=1.5)])
    ended = (
        ProbeResult(seq_len=64, outcome="fit", peak_memory_bytes=1000, time_s=0.01),
        ProbeResult(seq_len=128, outcome="oom", error="over budget", emulated=True),
    )
    pool = ThreadPool(script_for=lambda _c: Script(hang=True, probes=ended))
    worker = threading.Thread(target=make_scheduler(engine, pool).run_once, daemon=True)
    worker.start()

    def stored() -> tuple[RunStatus, list[int]]:
        with sm() as session:
            run = session.get(Run, run_id)
            assert run is not None
            return run.status, [p.seq_len for p in run.probes]

    wait_for(lambda: stored() == (RunStatus.running, [64, 128]), 10, "probes while running")
    worker.join(timeout=10)
    assert stored() == (RunStatus.timed_out, [64, 128]), "each probe once after the end"

    with sm() as session, session.begin():
        session.execute(update(Run).where(Run.id == run_id).values(status=RunStatus.queued))
        session.add(Probe(run_id=run_id, seq_len=32, outcome="fit"))
    claim = leases.claim_next(sm, "next-attempt", lease_s=30)
    assert claim is not None and claim.run_id == run_id
    assert stored() == (RunStatus.running, []), "a new attempt starts without old probes"


def test_infeasible_fails_at_once_with_the_message(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])

    pool = ThreadPool(script_for=lambda _c: Script(infeasible=("8 CPUs for 8 ranks", "4 CPUs")))
    assert make_scheduler(engine, pool).run_once()
    run = run_row(sm, run_id)
    assert run.status == RunStatus.failed
    assert run.error == "infeasible: the run needs 8 CPUs for 8 ranks; the cluster has 4 CPUs"
    assert pool.starts == Counter(), "no gang started"


@pytest.mark.parametrize(
    ("max_attempts", "status"), [(2, RunStatus.succeeded), (1, RunStatus.failed)]
)
def test_rank_failure_retries_up_to_max_attempts(
    engine: Engine, max_attempts: int, status: RunStatus
) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config(max_attempts=max_attempts)])
    pool = ThreadPool(script_for=lambda _c: Script(fail_attempts=1))
    sched = make_scheduler(engine, pool)
    assert sched.run_once()
    if max_attempts == 2:
        assert run_row(sm, run_id).status == RunStatus.queued, "requeued after the first failure"
        assert sched.run_once()
    run = run_row(sm, run_id)
    assert (run.status, run.attempts) == (status, max_attempts)
    assert pool.starts[0] == max_attempts
    if status == RunStatus.failed:
        assert run.error == "attempt 1/1: rank 1 failed: simulated death on start 1"
        assert rank_rows_per_run(sm) == Counter()
    else:
        assert run.error is None and rank_rows_per_run(sm) == Counter({run_id: 1})


def test_waiting_resources_is_shown_then_running(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(waiting_s=1.0, delay_s=1.0))
    worker = threading.Thread(target=make_scheduler(engine, pool).run_once)
    worker.start()
    seen: list[RunStatus] = []

    def record() -> bool:
        status = run_row(sm, run_id).status
        if not seen or seen[-1] != status:
            seen.append(status)
        return status == RunStatus.succeeded

    wait_for(record, what="succeeded")
    worker.join()
    assert RunStatus.waiting_resources in seen
    assert seen.index(RunStatus.waiting_resources) < len(seen) - 1
    assert seen[-2:] == [RunStatus.running, RunStatus.succeeded]


def test_graceful_stop_lets_the_run_finish(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    ids = add_sweep(sm, [tiny_config(seed=0), tiny_config(seed=1)])
    pool = ThreadPool(script_for=lambda _c: Script(delay_s=0.5))
    stop = threading.Event()
    # one run at a time: the second is still queued when the stop comes (two slots would
    # claim it beside the first, and the stop would let both finish)
    sched = make_scheduler(engine, pool, grace_s=5.0, max_concurrent=1)
    worker = threading.Thread(target=sched.run_forever, args=(stop,))
    worker.start()
    wait_for(lambda: run_row(sm, ids[0]).status == RunStatus.running, what="running")
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert [run_row(sm, i).status for i in ids] == [RunStatus.succeeded, RunStatus.queued]


def test_stop_past_grace_requeues_without_consuming_an_attempt(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(hang=True))
    stop = threading.Event()
    sched = make_scheduler(engine, pool, grace_s=0.2)
    worker = threading.Thread(target=sched.run_forever, args=(stop,))
    worker.start()
    wait_for(lambda: run_row(sm, run_id).status == RunStatus.running, what="running")
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive()
    run = run_row(sm, run_id)
    assert (run.status, run.attempts, run.lease_owner) == (RunStatus.queued, 0, None)
    assert pool.kills == ["scheduler stopping"]


def test_heartbeat_renews_the_lease(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(delay_s=1.0))
    sched = make_scheduler(engine, pool, lease_s=0.4, heartbeat_s=0.1)
    worker = threading.Thread(target=sched.run_once)
    worker.start()
    wait_for(lambda: run_row(sm, run_id).status == RunStatus.running, what="running")
    time.sleep(0.6)  # longer than the lease: only heartbeats keep it
    assert leases.recover_expired(sm) == []
    worker.join()
    assert run_row(sm, run_id).status == RunStatus.succeeded
    with sm() as session:
        assert session.scalar(select(func.count()).select_from(RankResultRow)) == 1


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="heartbeat_s"):
        Scheduler(None, pool=ThreadPool(), lease_s=1.0, heartbeat_s=2.0)  # type: ignore[arg-type]


def _rename_run_table(engine: Engine, old: str, new: str) -> None:
    # A real database error for every statement on `run` (what an outage looks like to us).
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))


def test_short_database_outage_is_ridden_out(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(delay_s=1.5))
    worker = threading.Thread(target=make_scheduler(engine, pool).run_once)
    worker.start()
    wait_for(lambda: run_row(sm, run_id).status == RunStatus.running, what="running")
    _rename_run_table(engine, "run", "run_away")
    time.sleep(0.5)  # several heartbeats fail; the lease (2 s) still holds
    _rename_run_table(engine, "run_away", "run")
    worker.join(timeout=10)
    run = run_row(sm, run_id)
    assert (run.status, run.attempts) == (RunStatus.succeeded, 1)
    assert pool.kills == []
    assert any("heartbeat failed" in r.getMessage() for r in caplog.records)


def test_outage_longer_than_the_lease_reruns_the_run(engine: Engine) -> None:
    sm = make_sessionmaker(engine)
    (run_id,) = add_sweep(sm, [tiny_config()])
    pool = ThreadPool(script_for=lambda _c: Script(delay_s=2.5))
    stop = threading.Event()
    sched = make_scheduler(engine, pool, lease_s=1.0, heartbeat_s=0.2)
    worker = threading.Thread(target=sched.run_forever, args=(stop,))
    worker.start()
    try:
        wait_for(lambda: run_row(sm, run_id).status == RunStatus.running, what="running")
        _rename_run_table(engine, "run", "run_away")
        wait_for(lambda: bool(pool.kills), what="the gang killed once the lease is lost")
        _rename_run_table(engine, "run_away", "run")
        wait_for(lambda: run_row(sm, run_id).status == RunStatus.succeeded, what="rerun")
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert pool.kills == ["lease lost: the database was unreachable"]
    assert run_row(sm, run_id).attempts == 2 and pool.starts[0] == 2
    assert rank_rows_per_run(sm) == Counter({run_id: 1})
