"""The scheduler on real gangs (the session's local Ray, gloo ranks): results, infeasible runs,
cancel, timeout, a killed rank retried, and a scheduler killed with -9 mid-sweep then restarted.

The tests share one GangPool, in order, so several of them run on the warm gang the test before
left (multihead -> max_seq_len -> the sweep's W=1 run at W=1; the sweep -> cancel at W=2; the
retried run -> the restarted scheduler at W=2).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _scheduler_helpers import (
    TINY,
    RecordingPool,
    add_sweep,
    cancel_as_api,
    live_placement_groups,
    long_config,
    migrated_sqlite,
    rank_rows_per_run,
    run_row,
    succeeded_run,
    tiny_config,
    wait_for,
)
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

import attention
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import upgrade
from service.db.models import TERMINAL_STATUSES, Run, RunStatus, SweepKind
from service.scheduler import Scheduler
from service.spec import SweepSpec, expand

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
HELPERS_DIR = Path(__file__).resolve().parents[1]
SCHEDULER_MAIN = (
    "import sys; from _scheduler_helpers import scheduler_main; "
    "scheduler_main(sys.argv[1], sys.argv[2], float(sys.argv[3]))"
)
"""A scheduler process on a real GangPool (tests/_scheduler_helpers.py), until killed."""
NEVER_ENDS = 10**7  # iterations: far longer than any test waits


@dataclass
class SharedPool:
    """The module's GangPool, and Ray's live placement groups when its first test began."""

    pool: Any
    before: set[str] | None = None


@pytest.fixture(scope="module")
def _shared_pool() -> Iterator[SharedPool]:
    """One GangPool for the module, so a run finds the warm gang the test before it left (a
    cold gang costs each rank a torch import on this 2-core machine); closed after the last
    test, which must leak no group."""
    from workers.gang import GangPool

    shared = SharedPool(GangPool(placement_timeout_s=60))
    yield shared
    shared.pool.close()
    if shared.before is not None:
        before = shared.before
        wait_for(lambda: live_placement_groups() <= before, what="placement groups removed")


@pytest.fixture
def gang_pool(ray_session: Any, _shared_pool: SharedPool) -> Iterator[RecordingPool]:
    """The module's real GangPool on the session Ray, recording this test's handles. After the
    test no placement group is left but the one warm gang the pool keeps for the next."""
    before = live_placement_groups()
    if _shared_pool.before is None:
        _shared_pool.before = before
    pool = RecordingPool(_shared_pool.pool)
    try:
        yield pool
    finally:
        pool.pool.placement_timeout_s = 60  # a test may shorten it
    wait_for(lambda: len(live_placement_groups() - before) <= 1, what="placement groups removed")


@pytest.fixture
def sqlite_sm(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """A migrated SQLite database (the Ray tests that need one backend only)."""
    with migrated_sqlite(tmp_path / "ringlab.db") as sm:
        yield sm


def scheduler(sm: sessionmaker[Session], pool: RecordingPool, **kwargs: Any) -> Scheduler:
    opts: dict[str, Any] = {"lease_s": 10.0, "heartbeat_s": 0.5, "poll_s": 0.05}
    return Scheduler(sm, pool=pool, **{**opts, **kwargs})


def run_in_thread(target: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def pids_of(pool: RecordingPool, index: int = -1) -> list[int]:
    """The rank processes of a run the pool started (empty until its gang is up)."""
    return [p.pid for p in pool.handles[index].placement()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(120)  # the first test: it may start the session's Ray too
def test_multihead_cell_runs_on_a_real_gang(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    """A multihead cell as a sweep stores it (embed_dim and num_heads unset: the rank sets them
    from num_heads x head_dim) runs, passes the gate against nn.MultiheadAttention in train mode
    and records the layer's FLOPs, projections included."""
    base = {**TINY, "kernel": "multihead", "params": {"kernel": "dense"}, "seq_len": 128}
    base |= {"mode": "train", "causal": True}
    (cell,) = expand(SweepSpec(name="mh", kind="correctness", base=base))
    assert (cell.config.params["embed_dim"], cell.config.params["num_heads"]) == (None, None)
    (run_id,) = add_sweep(sqlite_sm, [cell.config], kind=SweepKind.correctness)
    assert scheduler(sqlite_sm, gang_pool).run_once()
    with succeeded_run(sqlite_sm, run_id) as (_, run):
        (rank,) = run.rank_results
        assert 0 < (rank.max_abs_error or 0) <= 1e-4 and rank.check_seq_len == 128
        layer = attention.build("multihead", kernel="dense", embed_dim=32, num_heads=2)
        assert rank.flops == layer.flops(1, 128, 2, 16, causal=True, backward=True)


@pytest.mark.timeout(60)
def test_max_seq_len_run_stores_its_probes(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    config = tiny_config(
        seq_len=64,
        memory_budget_bytes=1,  # every probe exceeds a 1-byte budget: an emulated OOM
        search={"start": 64, "max": 256, "granularity": 64},
    )
    (run_id,) = add_sweep(sqlite_sm, [config], kind=SweepKind.max_seq_len)
    assert scheduler(sqlite_sm, gang_pool).run_once()
    with sqlite_sm() as session:
        run = session.get(Run, run_id)
        assert run is not None
        assert run.probes, f"no probes stored (status {run.status}, error {run.error})"
        assert run.probes[0].seq_len == 64 and run.probes[0].outcome == "oom"
        assert run.probes[0].emulated


@pytest.mark.timeout(120)
def test_sweep_runs_on_real_gangs(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    sm = sqlite_sm
    configs = [
        tiny_config(seed=0),
        tiny_config(seed=1, world_size=2, parallel="data", batch_size=2),
        tiny_config(seed=2, world_size=2, parallel="data", batch_size=2, seq_len=128),
    ]
    ids = add_sweep(sm, configs)
    sched = scheduler(sm, gang_pool)
    while sched.run_once():
        pass
    runs = [run_row(sm, i) for i in ids]
    assert [(r.status, r.error, r.attempts) for r in runs] == [(RunStatus.succeeded, None, 1)] * 3
    assert rank_rows_per_run(sm) == Counter({ids[0]: 1, ids[1]: 2, ids[2]: 2})
    assert len({r.environment_id for r in runs}) == 1 and runs[0].environment_id is not None
    with sm() as session:
        run = session.get(Run, ids[2])
        assert run is not None
        for rr in run.rank_results:
            assert rr.median_s > 0 and rr.tokens_per_s > 0 and rr.peak_memory_bytes >= 0
            assert len(rr.times_s) == 2 and rr.backend


@pytest.mark.timeout(60)
def test_infeasible_run_fails_at_once(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    (run_id,) = add_sweep(sqlite_sm, [tiny_config(world_size=9, parallel="data", batch_size=9)])
    t0 = time.monotonic()
    assert scheduler(sqlite_sm, gang_pool).run_once()
    assert time.monotonic() - t0 < 5
    run = run_row(sqlite_sm, run_id)
    assert run.status == RunStatus.failed
    assert (run.error or "").startswith("infeasible: the run needs 9 CPU")
    assert "8 CPU in total" in (run.error or "")
    assert gang_pool.handles == []


@pytest.mark.timeout(90)
def test_cancel_kills_the_gang_and_stays_cancelled(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    (run_id,) = add_sweep(sqlite_sm, [long_config(iterations=NEVER_ENDS)])
    worker = run_in_thread(scheduler(sqlite_sm, gang_pool).run_once)
    wait_for(lambda: bool(gang_pool.handles) and bool(pids_of(gang_pool)), 60, "gang up")
    pids = pids_of(gang_pool)
    cancel_as_api(sqlite_sm, run_id)
    worker.join(timeout=30)
    assert not worker.is_alive()
    wait_for(lambda: all(gone(p) for p in pids), 30, "rank processes killed")
    run = run_row(sqlite_sm, run_id)
    assert (run.status, run.error) == (RunStatus.cancelled, "cancelled by request")
    assert rank_rows_per_run(sqlite_sm) == Counter()


@pytest.mark.timeout(90)
def test_timeout_kills_the_gang(sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool) -> None:
    (run_id,) = add_sweep(sqlite_sm, [long_config(iterations=NEVER_ENDS, timeout_s=8)])
    assert scheduler(sqlite_sm, gang_pool).run_once()
    run = run_row(sqlite_sm, run_id)
    assert (run.status, run.error) == (RunStatus.timed_out, "timed out after 8 s")
    pids = pids_of(gang_pool)
    wait_for(lambda: all(gone(p) for p in pids), 30, "rank processes killed")


@pytest.mark.timeout(120)
def test_killed_rank_fails_the_attempt_and_the_retry_succeeds(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    (run_id,) = add_sweep(sqlite_sm, [long_config(iterations=3000, max_attempts=2)])
    sched = scheduler(sqlite_sm, gang_pool)
    worker = run_in_thread(sched.run_once)
    wait_for(lambda: bool(gang_pool.handles) and bool(pids_of(gang_pool)), 60, "gang up")
    os.kill(pids_of(gang_pool)[1], signal.SIGKILL)
    worker.join(timeout=60)
    run = run_row(sqlite_sm, run_id)
    assert (run.status, run.attempts) == (RunStatus.queued, 1)
    assert (run.error or "").startswith("attempt 1/2: rank 1 failed: ")
    assert sched.run_once()
    run = run_row(sqlite_sm, run_id)
    assert (run.status, run.attempts, run.error) == (RunStatus.succeeded, 2, None)
    assert rank_rows_per_run(sqlite_sm) == Counter({run_id: 2})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)  # the multi-process backend
def test_scheduler_killed_mid_sweep_then_restarted_runs_each_run_once(
    database_url: str, gang_pool: RecordingPool, ray_session: Any
) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    sm = make_sessionmaker(engine)
    ids = add_sweep(sm, [long_config(seed=i, iterations=3000) for i in range(3)])
    address = ray_session.get_runtime_context().gcs_address
    lease_s = 30.0  # the default: recovery must not wait for it to expire
    proc = subprocess.Popen(
        [sys.executable, "-c", SCHEDULER_MAIN, database_url, address, str(lease_s)],
        cwd=ROOT,  # the repository first on sys.path: tests/attention would shadow attention
        env={**os.environ, "PYTHONPATH": str(HELPERS_DIR)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: (
                run_row(sm, ids[0]).status == RunStatus.succeeded
                and any(run_row(sm, i).status == RunStatus.running for i in ids[1:])
            ),
            90,
            "the first run done and a later one running",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    interrupted = [i for i in ids if run_row(sm, i).status == RunStatus.running]
    assert len(interrupted) == 1, "killed while one run was running"
    stop = threading.Event()
    restarted_at = time.monotonic()
    restarted = run_in_thread(
        scheduler(sm, gang_pool, lease_s=lease_s, heartbeat_s=0.5).run_forever, stop
    )
    try:
        (run_id,) = interrupted
        wait_for(
            lambda: run_row(sm, run_id).attempts == 2 or run_row(sm, run_id).status != "running",
            10,
            "the interrupted run requeued or running again within 10 s of the restart",
        )
        assert time.monotonic() - restarted_at < 10
        wait_for(
            lambda: all(run_row(sm, i).status in TERMINAL_STATUSES for i in ids),
            120,
            "the sweep finished",
        )
    finally:
        stop.set()
        restarted.join(timeout=30)
    runs = [run_row(sm, i) for i in ids]
    assert [r.status for r in runs] == [RunStatus.succeeded] * 3
    assert [r.attempts for r in runs] == [2 if i in interrupted else 1 for i in ids], (
        "only the interrupted run ran again"
    )
    assert rank_rows_per_run(sm) == Counter(dict.fromkeys(ids, 2)), "every result exactly once"
    engine.dispose()


def _migrated(engine: Engine) -> bool:
    """At the last revision, not merely past the first: a sweep inserted while later
    migrations still run would miss their columns."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from service.db.migrate import alembic_config

    head = ScriptDirectory.from_config(alembic_config(str(engine.url))).get_current_head()
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head


def _block_all_but_one_cpu(ray_session: Any, gang_pool: RecordingPool) -> Any:
    """A placement group holding every CPU of the cluster but one: a W=2 gang must wait.

    Sized from the total, not from what is free now: the previous test's gang may still be
    releasing its CPUs, and a blocker sized from a momentary reading would leave room for two.
    ready() waits until those CPUs are back (the pool's warm gang is removed first: it would
    hold two of them), then exactly one stays free.
    """
    from ray.util.placement_group import placement_group

    from workers.cluster import describe

    gang_pool.pool.close()
    total = int(describe()["total_cpus"])
    assert total >= 2, f"the session Ray has {total} CPUs; the test needs 2"
    blocker = placement_group([{"CPU": 1}] * (total - 1))
    ray_session.get(blocker.ready(), timeout=30)
    return blocker


@pytest.mark.timeout(150)
def test_busy_cluster_shows_waiting_resources_then_runs(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool, ray_session: Any
) -> None:
    from ray.util.placement_group import remove_placement_group

    (run_id,) = add_sweep(sqlite_sm, [long_config(iterations=3000)])
    blocker = _block_all_but_one_cpu(ray_session, gang_pool)
    try:
        worker = run_in_thread(scheduler(sqlite_sm, gang_pool).run_once)
        wait_for(
            lambda: run_row(sqlite_sm, run_id).status == RunStatus.waiting_resources,
            30,
            "waiting_resources",
        )
    finally:
        remove_placement_group(blocker)
    seen = {RunStatus.waiting_resources}

    def finished() -> bool:
        seen.add(run_row(sqlite_sm, run_id).status)
        return not worker.is_alive()

    wait_for(finished, 110, "the run to finish once placed")  # a loaded 2-core CI
    assert run_row(sqlite_sm, run_id).status == RunStatus.succeeded
    assert RunStatus.running in seen, "back to running once the ranks were placed"


@pytest.mark.timeout(90)
def test_placement_deadline_fails_the_run_with_what_is_free(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool, ray_session: Any
) -> None:
    from ray.util.placement_group import remove_placement_group

    (run_id,) = add_sweep(sqlite_sm, [long_config(iterations=2)])
    gang_pool.pool.placement_timeout_s = 2.0
    blocker = _block_all_but_one_cpu(ray_session, gang_pool)
    try:
        assert scheduler(sqlite_sm, gang_pool).run_once()
    finally:
        remove_placement_group(blocker)
    run = run_row(sqlite_sm, run_id)
    assert run.status == RunStatus.failed
    assert "attempt 1/1: the 2 bundles of {'CPU': 1.0}" in (run.error or "")
    assert "were not ready within 2 s; free now: 1 CPU" in (run.error or "")


@pytest.mark.timeout(180)
def test_model_search_runs_on_a_real_gang_and_stores_its_components(
    sqlite_sm: sessionmaker[Session], gang_pool: RecordingPool
) -> None:
    """A workload: model max_seq_len cell, as a sweep stores it, runs on a real gang: its search
    starts from the predicted maximum, and the answer's memory components are stored predicted
    and measured, with the prediction the read model and the report show beside the finding."""
    from service.db.models import Sweep
    from service.results import queries
    from service.results.report import report_markdown
    from workers import model_memory
    from workers.search import predicted_start

    spec = SweepSpec(
        name="model",
        kind="max_seq_len",
        base={
            "workload": "model",
            "kernel": "dense",
            "device": "cpu",
            "model": {
                "name": "tiny",
                "d_model": 128,
                "n_layers": 2,
                "n_heads": 4,
                "vocab_size": 4096,
            },
            "memory_budget_bytes": 256 << 20,
            "warmup": 1,
            "iterations": 1,
        },
        # fresh processes: each probe measures in a new rank, not one whose math libraries
        # hold buffers for the shapes of every earlier test (those are not predicted)
        search={"start": 1024, "max": 65536, "granularity": 64, "fresh_processes": True},
    )
    (cell,) = expand(spec)
    predicted = predicted_start(cell.config)
    assert predicted == model_memory.max_seq_len(cell.config, 256 << 20) and predicted > 1024
    (run_id,) = add_sweep(sqlite_sm, [cell.config], kind=SweepKind.max_seq_len)
    assert scheduler(sqlite_sm, gang_pool).run_once()
    with succeeded_run(sqlite_sm, run_id) as (session, run):
        assert run.probes[0].seq_len == predicted  # dense accepts any length: no snapping
        fits = [p.seq_len for p in run.probes if p.outcome == "fit"]
        (rank,) = run.rank_results
        assert rank.seq_len == max(fits) and rank.predicted_max_seq_len == predicted
        assert abs(rank.seq_len / predicted - 1) <= 0.10
        assert 0 < rank.forward_s < rank.median_s and 0 < rank.backward_s < rank.median_s
        sweep = session.get(Sweep, run.sweep_id)
        assert sweep is not None
        (row,) = queries.sweep_rows(session, sweep)
        stored = {c.component: c for c in row.components}
        assert set(stored) == {*model_memory.COMPONENTS, "optimizer_state_tensors"}
        at_answer = model_memory.predict(cell.config, rank.seq_len)
        assert stored["parameters"].predicted_bytes == at_answer.parameters
        assert stored["activations"].predicted_bytes == at_answer.activations
        assert stored["step_peak"].measured_bytes == rank.peak_memory_bytes
        state = stored["optimizer_state_tensors"]
        assert state.measured_bytes == state.predicted_bytes  # AdamW: 2 moments + steps, exact
        act = stored["activations"]
        assert act.ratio is not None and abs(act.ratio - 1) <= 0.15
        fixed = sum(stored[n].measured_bytes or 0 for n in model_memory.COMPONENTS[:3])
        assert row.fixed_bytes == fixed
        assert row.bytes_per_token == (rank.peak_memory_bytes - fixed) / rank.seq_len
        report = report_markdown(sweep, [row], [], {"succeeded": 1}, None)
    line = next(x for x in report.splitlines() if x.startswith("| tiny |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["tiny", "128d×4h×2L", "adamw", "fp32", "none"]
    assert cells[6:8] == [f"{rank.seq_len:,}", f"{predicted:,}"]
    assert cells[9] == f"{(rank.peak_memory_bytes - fixed) / rank.seq_len / 1e3:,.1f}"
