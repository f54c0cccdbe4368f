"""Running a service's queue to the end the way the service does: a real Scheduler placing each
run's ranks on a real GangPool (local Ray). For the Ray-marked tests that go through the API."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from service.artifacts import ArtifactStore
from service.scheduler import Scheduler
from workers.gang import GangPool


def run_queue(sm: sessionmaker[Session], artifacts: ArtifactStore | None = None) -> int:
    """Claim and run queued runs until none is left, then close the pool; the runs it ran."""
    pool = GangPool(placement_timeout_s=120)
    scheduler = Scheduler(sm, pool=pool, lease_s=60, heartbeat_s=5, artifacts=artifacts)
    ran = 0
    try:
        while scheduler.run_once():
            ran += 1
    finally:
        pool.close()
    return ran
