"""Per-step compute and wait of the ring kernels, measured by the protocol on real gloo ranks:
the steps tile each iteration, the bytes are the K/V that travel, and a slow rank shows up as
time the other rank waits."""

from __future__ import annotations

import time
from typing import Any

import pytest
from _dist_helpers import run_ranks

from workers import protocol
from workers.config import RunConfig

RING_KERNELS = [
    ("ring", {}),
    ("ring_block_sparse", {"block_size": 64, "pattern": "local_window", "window": 2}),
    ("ring_dilated", {"segment_lengths": [256, 1024], "dilation_rates": [1, 2]}),
]


def _config(kernel: str, params: dict, world: int, **extra: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "kernel": kernel,
            "params": params,
            "seq_len": 1024,
            "num_heads": 2,
            "head_dim": 16,
            "world_size": world,
            "mode": "train",
            "warmup": 1,
            "iterations": 3,
            **extra,
        }
    )


def measured(rank: int, world: int, kernel: str, params: dict) -> dict[str, Any]:
    case = protocol.run_case(_config(kernel, params, world), rank)
    assert case.status == "ok", case.error
    return case.result.model_dump()


@pytest.mark.parametrize(("kernel", "params"), RING_KERNELS)
def test_steps_tile_every_iteration_and_count_the_bytes(kernel: str, params: dict) -> None:
    world = 2
    for r in run_ranks(measured, world, kernel, params):
        steps = r["steps"]
        assert {s["iteration"] for s in steps} == {0, 1, 2}
        assert {s["phase"] for s in steps} == {"forward", "backward"}
        for i, t in enumerate(r["times_s"]):
            mine = [s for s in steps if s["iteration"] == i]
            covered = sum(s["compute_s"] + s["wait_s"] for s in mine)
            # the steps lie inside the iteration (at these tiny shapes setup outside them is a
            # large share; bench/ring.py --steps shows how much they cover at 16K)
            assert 0 < covered <= t
        # the totals stored with the rank are the sums of its steps
        assert r["step_wait_s"] == pytest.approx(sum(s["wait_s"] for s in steps))
        assert r["step_compute_s"] == pytest.approx(sum(s["compute_s"] for s in steps))
        received = sum(s["received_bytes"] for s in steps)
        assert r["step_received_bytes"] == received > 0
        if kernel == "ring":
            # a forward step brings the K and V of 512 tokens (2 heads x 16 x fp32)
            fwd = [s for s in steps if s["phase"] == "forward" and s["iteration"] == 0]
            assert [s["step"] for s in fwd] == [0, 1]
            assert fwd[0]["received_bytes"] == 2 * 512 * 2 * 16 * 4
            assert fwd[1]["received_bytes"] == 0  # the last step posts nothing
        # every step that received bytes timed their transfer's window; the rank keeps its best
        rates = [s["transfer_window_bytes_per_s"] for s in steps if s["received_bytes"]]
        assert all(rate > 0 for rate in rates)
        assert r["transfer_window_bytes_per_s"] == pytest.approx(max(rates))
        # the link was probed apart, before the loop, with this rank's K and V shard
        assert r["link_probe_bytes"] == 2 * 512 * 2 * 16 * 4
        assert r["link_probe_bytes_per_s"] > 0 and r["link_latency_s"] > 0


def slow_rank_case(rank: int, world: int, delay_s: float) -> dict[str, Any]:
    """Rank 1 sleeps `delay_s` in every backward block it computes, before it can send the
    dK/dV accumulator on: rank 0 must wait for it."""
    from attention.ring import engine

    if rank == 1:
        original = engine.block_grads

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return original(*args, **kwargs)

        engine.block_grads = slow  # type: ignore[assignment]
    case = protocol.run_case(_config("ring", {}, world), rank)
    assert case.status == "ok", case.error
    return case.result.model_dump()


def test_a_slow_rank_is_seen_in_the_waits_of_the_other() -> None:
    delay = 0.05
    fast, slow = run_ranks(slow_rank_case, 2, delay)

    def waits(r: dict[str, Any]) -> float:
        backward = [s for s in r["steps"] if s["phase"] == "backward"]
        return sum(s["wait_s"] for s in backward) / len(r["times_s"])

    # per iteration rank 1 sleeps twice (one block per step) before its dK/dV go on; rank 0
    # waits for the first at step 1 and for the second when its own dK/dV come home (step 2)
    assert waits(fast) >= 1.5 * delay
    assert waits(slow) < 0.5 * delay
    home = [s for s in fast["steps"] if s["phase"] == "backward" and s["step"] == 2]
    assert home and min(s["wait_s"] for s in home) >= 0.8 * delay
