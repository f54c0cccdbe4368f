"""A gang whose rank actors cannot start fails within 30 s with Ray's own reason (the raylet's
error), on the session's real local Ray: before, the run stayed `running` for minutes and then
failed with a guess about pip installs, holding the queue all that time."""

from __future__ import annotations

import time
from typing import Any

import pytest
from _scheduler_helpers import live_placement_groups, tiny_config, wait_for

from workers.errors import ActorsNotStarted
from workers.gang import GangPool

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def test_actors_that_cannot_start_fail_within_30_s_with_rays_reason(ray_session: Any) -> None:
    # An env name Ray's worker cannot set: submit refuses it now (RunConfig's env check), so
    # it is put past validation here, as a runtime env Ray rejects would be.
    config = tiny_config().model_copy(update={"env": {"NCCL_A=B": "1"}})
    before = live_placement_groups()
    pool = GangPool(placement_timeout_s=60)
    t0 = time.monotonic()
    try:
        handle = pool.start(config, "benchmark")
        with pytest.raises(ActorsNotStarted) as failed:
            while handle.poll(0.5) is None:
                assert time.monotonic() - t0 < 60, "still starting after 60 s"
        elapsed = time.monotonic() - t0
        handle.kill(str(failed.value))  # what the scheduler does with a GangError
    finally:
        pool.close()
    message = str(failed.value)
    print(f"failed after {elapsed:.1f} s: {message}")
    assert elapsed < 30, message
    assert "illegal environment variable name" in message, "Ray's own reason"
    assert "PENDING_CREATION" in message
    wait_for(lambda: live_placement_groups() <= before, 30, "placement groups removed")
