"""Warm gangs give back what they hold when anyone waits: two schedulers (two teams, each with
its own database and sweep) share one real Ray with 4 free CPUs. The first's finished gangs
stay warm; the second's gang then waits for bundles only until the first's pool sees Ray's
pending demand (read from the GCS's autoscaler state), far within the idle TTL. And an idle
gang nobody asks for goes back after RINGLAB_WARM_GANG_TTL_S."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _scheduler_helpers import add_sweep, live_placement_groups, migrated_sqlite, run_row, wait_for
from _workers_helpers import config, wait

from service.db.models import TERMINAL_STATUSES, RunStatus
from service.scheduler import Scheduler
from workers.gang import GangPool

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _hold_all_but(ray: Any, free: int) -> Any:
    """A placement group holding every CPU of the session's Ray but `free` (ready)."""
    from ray.util.placement_group import placement_group

    total = int(ray.cluster_resources()["CPU"])
    group = placement_group([{"CPU": 1.0}] * (total - free))
    ray.get(group.ready(), timeout=60)
    return group


def test_a_warm_gang_is_given_back_when_another_scheduler_waits(
    tmp_path: Path, ray_session: Any
) -> None:
    from ray.util.placement_group import remove_placement_group

    blocker = _hold_all_but(ray_session, free=4)
    pools = [GangPool(placement_timeout_s=120), GangPool(placement_timeout_s=120)]
    stops = [threading.Event(), threading.Event()]
    threads: list[threading.Thread] = []
    try:
        with migrated_sqlite(tmp_path / "a.db") as sm_a, migrated_sqlite(tmp_path / "b.db") as sm_b:
            gang = {"world_size": 2, "parallel": "data", "batch_size": 2, "timeout_s": 90}
            ids_a = add_sweep(sm_a, [config(**gang, seed=i) for i in range(2)], name="a")
            for sm, pool, stop in zip((sm_a, sm_b), pools, stops, strict=True):
                sched = Scheduler(sm, pool=pool, poll_s=0.1)
                threads.append(threading.Thread(target=sched.run_forever, args=(stop,)))
                threads[-1].start()
            wait_for(
                lambda: all(run_row(sm_a, i).status in TERMINAL_STATUSES for i in ids_a),
                120,
                "the first scheduler's sweep",
            )
            assert len(pools[0]._idle) >= 1, "its gangs stay warm while nobody waits"
            (id_b,) = add_sweep(sm_b, [config(**gang)], name="b")
            wait_for(lambda: run_row(sm_b, id_b).status in TERMINAL_STATUSES, 90, "b's run")
            run_b = run_row(sm_b, id_b)
        assert run_b.status == RunStatus.succeeded, run_b.error
        assert run_b.started_at is not None and run_b.finished_at is not None
        waited = (run_b.finished_at - run_b.started_at).total_seconds()
        assert waited < 30, f"b's run took {waited:.0f} s: the idle TTL is 60 s"
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join(timeout=30)
        for pool in pools:
            pool.close()
        remove_placement_group(blocker)


def test_an_idle_gang_goes_back_after_its_ttl(ray_session: Any) -> None:
    before = live_placement_groups()
    pool = GangPool(placement_timeout_s=60, warm_ttl_s=1.0)
    try:
        outcome = wait(pool.start(config(), "benchmark"))
        assert outcome.status == "succeeded", outcome.error
        assert len(pool._idle) == 1 and live_placement_groups() > before
        t0 = time.monotonic()
        wait_for(lambda: not pool._idle, 10, "the idle gang given back")
        assert time.monotonic() - t0 < 3.5
        wait_for(lambda: live_placement_groups() <= before, 10, "its placement group removed")
    finally:
        pool.close()
