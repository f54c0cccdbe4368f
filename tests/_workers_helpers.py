"""Helpers for the workers/ tests: run configs, waiting on a handle, leak checks against Ray."""

from __future__ import annotations

import time
from typing import Any

from _results_helpers import timing

from workers.config import RunConfig
from workers.gang import RunHandle
from workers.results import RankResult, RunOutcome

SMALL = {"num_heads": 2, "head_dim": 16, "warmup": 1, "iterations": 3}


def config(**fields: Any) -> RunConfig:
    """A small CPU run config (dense, 512 tokens) with `fields` on top."""
    base: dict[str, Any] = {"kernel": "dense", "seq_len": 512, "device": "cpu", **SMALL}
    return RunConfig.model_validate({**base, **fields})


def planted_result(seq_len: int, median_s: float, peak: int) -> RankResult:
    """Rank 0's measurement at `seq_len` as a planted probe runner reports it: one time of
    `median_s`, one FLOP, `peak` bytes."""
    fields = timing([median_s], seq_len, 1.0)
    return RankResult(rank=0, seq_len=seq_len, peak_memory_bytes=peak, backend="sdpa", **fields)


def wait(handle: RunHandle, timeout_s: float = 120.0) -> RunOutcome:
    """Poll like the scheduler does until the run ends; fail the test past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = handle.poll(0.05)
        if outcome is not None:
            return outcome
    handle.kill("test timeout")
    raise AssertionError(f"run did not end within {timeout_s} s")


def live_rank_actors() -> list[dict[str, Any]]:
    """Rank actors Ray still counts as alive (or about to be)."""
    from ray._private.state import actors

    return [
        a
        for a in actors().values()
        if "RankActor" in str(a.get("ActorClassName", "")) and a.get("State") != "DEAD"
    ]


def live_placement_groups() -> list[dict[str, Any]]:
    """Placement groups not yet removed."""
    from ray.util import placement_group_table

    return [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]


def assert_no_leaks(timeout_s: float = 15.0) -> None:
    """No rank actor and no placement group survives (Ray updates its tables asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors, groups = live_rank_actors(), live_placement_groups()
        if not actors and not groups:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: {len(actors)} rank actors, placement groups {groups}")
        time.sleep(0.1)
