"""Gangs of rank actors on the shared local Ray (8 logical CPUs): results, reuse, failures, search.

The tests share one pool, in order, so most of them run on the warm W=2 gang (a cold gang costs
seconds of torch imports on this 2-core machine).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from _workers_helpers import (
    assert_no_leaks,
    config,
    live_placement_groups,
    live_rank_actors,
    wait,
)
from ray.util.placement_group import placement_group, remove_placement_group

from workers.cluster import describe
from workers.errors import GangError, Infeasible, PlacementTimeout, RankFailed
from workers.gang import GangPool
from workers.results import RunOutcome

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def _shared_pool() -> Iterator[GangPool]:
    import ray

    pool = GangPool(placement_timeout_s=60)
    yield pool
    if ray.is_initialized():
        pool.close()
        assert_no_leaks()


@pytest.fixture
def pool(ray_session, _shared_pool: GangPool) -> GangPool:  # type: ignore[no-untyped-def]
    """The module's pool on the session Ray (warm gangs carry over between tests)."""
    return _shared_pool


def _assert_measured(outcome, world: int) -> None:  # type: ignore[no-untyped-def]
    assert outcome.status == "succeeded", outcome.error
    assert [r.rank for r in outcome.ranks] == list(range(world))
    for rank in outcome.ranks:
        assert rank.tokens_per_s > 0 and rank.flops_per_s > 0
        assert rank.peak_memory_bytes > 0 and len(rank.times_s) == 3
    assert len({p.pid for p in outcome.placement}) == world
    assert outcome.environment is not None and len(outcome.environment.hash()) == 64


def _data_then_sequence(pool: GangPool, world: int) -> RunOutcome:
    """A data-parallel run of W ranks, then a sequence-parallel one on the same (warm) gang;
    returns the first one's outcome."""
    data = config(world_size=world, batch_size=world, parallel="data")
    outcome = wait(pool.start(data, "benchmark"))
    _assert_measured(outcome, world)
    assert outcome.gang_start_s is not None and outcome.gang_start_s > 0
    # sequence mode on the same (warm) gang: ring shards one sequence over the ranks
    kernel = "ring" if world > 1 else "dense"
    seq = config(kernel=kernel, world_size=world, causal=True, correctness_check=True)
    sharded = wait(pool.start(seq, "benchmark"))
    _assert_measured(sharded, world)
    assert sharded.gang_start_s is None
    assert [p.pid for p in sharded.placement] == [p.pid for p in outcome.placement]
    for rank in sharded.ranks:
        assert rank.max_abs_error is not None and rank.max_abs_error < 1e-4
        assert rank.tokens_per_s == pytest.approx(512 / world / rank.median_s)
    # zigzag balances causal work: every rank computes 1/W of the pairs
    total = 4 * (512 * 513 // 2) * 2 * 16
    assert sum(r.flops for r in sharded.ranks) == total
    return outcome


def test_world_sizes_in_data_and_sequence_modes(pool: GangPool) -> None:
    """W=4, 1 and 2, each in both modes; at W=1 (one rank to start, not two) a run in fresh
    processes takes no warm gang, and its gang is not kept. W=2 goes last: the tests after
    this one run on its warm gang."""
    _data_then_sequence(pool, 4)
    one = _data_then_sequence(pool, 1)
    cfg = config()
    fresh = wait(pool.start(cfg.model_copy(update={"fresh_processes": True}), "benchmark"))
    assert fresh.status == "succeeded" and fresh.gang_start_s is not None
    assert not {p.pid for p in fresh.placement} & {p.pid for p in one.placement}
    cold = wait(pool.start(cfg, "benchmark"))  # the fresh gang was not kept
    warm = wait(pool.start(cfg, "benchmark"))
    assert cold.gang_start_s is not None and warm.gang_start_s is None
    assert [p.pid for p in warm.placement] == [p.pid for p in cold.placement]
    _data_then_sequence(pool, 2)


def test_data_mode_splits_the_batch(pool: GangPool) -> None:
    cfg = config(world_size=2, batch_size=4, parallel="data", seq_len=1024)
    handle = pool.start(cfg, "benchmark")
    outcome = wait(handle)
    assert outcome.status == "succeeded", outcome.error
    handle.kill("too late: the run ended")  # a no-op: the warm gang stays in the pool
    assert handle.poll(0) == outcome
    again = wait(pool.start(cfg, "benchmark"))
    assert again.gang_start_s is None
    assert [p.pid for p in again.placement] == [p.pid for p in outcome.placement]
    for rank in outcome.ranks:  # each rank runs 2 of the 4 rows
        assert rank.flops == 4 * 2 * 1024 * 1024 * 2 * 16
        assert rank.tokens_per_s == pytest.approx(2 * 1024 / rank.median_s)


def test_sequence_mode_trains_a_ring(pool: GangPool) -> None:
    cfg = config(kernel="ring", world_size=2, mode="train", causal=True, correctness_check=True)
    outcome = wait(pool.start(cfg, "benchmark"))
    assert outcome.status == "succeeded", outcome.error
    assert outcome.gang_start_s is None  # the W=2 gang of the tests before
    assert [r.flops for r in outcome.ranks] == [3.5 * 2 * (512 * 513 // 2) * 2 * 16] * 2
    assert all(r.max_abs_error < 1e-4 for r in outcome.ranks)


def test_correctness_gate_and_kind(pool: GangPool) -> None:
    cfg = config(world_size=2, batch_size=2, parallel="data", correctness_check=True)
    outcome = wait(pool.start(cfg, "correctness"))
    assert outcome.status == "succeeded", outcome.error
    assert all(r.max_abs_error is not None and r.max_abs_error <= 1e-4 for r in outcome.ranks)


def test_infeasible_run_fails_fast_with_its_message(pool: GangPool) -> None:
    started = time.monotonic()
    with pytest.raises(Infeasible, match=r"needs 9 CPU .*has 8 CPU in total on 1 node"):
        pool.start(config(world_size=9, batch_size=9, parallel="data"), "benchmark")
    with pytest.raises(Infeasible, match=r"needs 2 distinct nodes .* 1 node\(s\) with a CPU"):
        pool.start(
            config(world_size=2, batch_size=2, parallel="data", placement="strict_spread"),
            "benchmark",
        )
    with pytest.raises(Infeasible, match=r"needs 1 GPU"):
        pool.start(config(device="cuda"), "benchmark")
    assert time.monotonic() - started < 5


def test_busy_cluster_waits_then_times_out(pool: GangPool) -> None:
    held = {pg["placement_group_id"] for pg in live_placement_groups()}
    # Every CPU: the pool's idle warm gang gives its CPUs back to this pending demand first.
    total = int(describe()["total_cpus"])
    blocker = placement_group([{"CPU": 1}] * total)
    assert blocker.wait(30)
    other = GangPool(placement_timeout_s=1.5)
    waited: list[bool] = []
    try:
        handle = other.start(config(), "benchmark", on_waiting=lambda: waited.append(True))
        assert waited == [True]
        with pytest.raises(PlacementTimeout, match=r"not ready within 1\.5 s"):
            wait(handle, timeout_s=30)
    finally:
        other.close()
        remove_placement_group(blocker)
    # nothing more than before is left (the shared pool's warm gang went back to Ray)
    assert {pg["placement_group_id"] for pg in live_placement_groups()} <= held


def test_killed_rank_fails_the_run_and_the_next_run_succeeds(pool: GangPool) -> None:
    cfg = config(world_size=2, batch_size=2, parallel="data")
    first = wait(pool.start(cfg, "benchmark"))
    long = cfg.model_copy(update={"seq_len": 2048, "iterations": 2000})
    handle = pool.start(long, "benchmark")  # the warm gang: pids are known
    victim = next(p for p in first.placement if p.rank == 1)
    time.sleep(1.0)
    assert handle.poll(0) is None
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(RankFailed, match="rank 1 failed") as info:
        wait(handle, timeout_s=60)
    assert info.value.rank == 1
    assert_no_leaks()  # the broken gang is torn down
    after = wait(pool.start(cfg, "benchmark"))
    assert after.status == "succeeded" and after.gang_start_s is not None


def test_a_warm_gang_that_lost_a_rank_while_idle_is_replaced(pool: GangPool) -> None:
    """A rank process killed between runs: the next run with that key does not spend its
    attempt on the dead gang; it gets a new one (a cold start) and succeeds."""
    cfg = config(world_size=2, batch_size=2, parallel="data")
    first = wait(pool.start(cfg, "benchmark"))
    assert first.status == "succeeded", first.error
    victim = next(p for p in first.placement if p.rank == 0)
    os.kill(victim.pid, signal.SIGKILL)
    after = wait(pool.start(cfg, "benchmark"))
    assert after.status == "succeeded", after.error
    assert after.gang_start_s is not None, "a new gang was started"
    assert victim.pid not in {p.pid for p in after.placement}


def test_kill_cancels_a_run_and_frees_its_gang(pool: GangPool) -> None:
    cfg = config(world_size=2, batch_size=2, parallel="data", seq_len=2048, iterations=2000)
    handle = pool.start(cfg, "benchmark")
    time.sleep(0.5)
    handle.kill("cancelled by the test")
    handle.kill("twice is harmless")
    with pytest.raises(GangError, match="killed: cancelled by the test"):
        handle.poll(5)
    assert_no_leaks()
    assert not live_rank_actors()


def test_search_finds_a_planted_cpu_budget(pool: GangPool) -> None:
    per_token = 4 * 4 * 32 * 4  # q, k, v, out: fp32, 4 heads of 32
    budget = 3000 * per_token
    granularity = 128
    cfg = config(
        num_heads=4,
        head_dim=32,
        seq_len=512,
        warmup=0,
        iterations=1,
        memory_budget_bytes=budget,
        search={"start": 512, "max": 1 << 20, "granularity": granularity},
    )
    outcome = wait(pool.start(cfg, "max_seq_len"))
    assert outcome.status == "succeeded", outcome.error
    answer = outcome.answer_seq_len
    fits = [p.seq_len for p in outcome.probes if p.outcome == "fit"]
    ooms = [p.seq_len for p in outcome.probes if p.outcome == "oom"]
    assert answer == max(fits)
    assert min(o for o in ooms if o > answer) - answer <= granularity
    assert all(p.emulated for p in outcome.probes if p.outcome == "oom")
    assert 0.5 * 3000 <= answer <= 3000  # the peak holds at least the floor, at most 2x it
    assert [p.seq_len for p in outcome.probes][:3] == [512, 1024, 2048]
    fit = next(p for p in outcome.probes if p.seq_len == answer)
    assert fit.peak_memory_bytes <= budget and fit.time_s > 0
    assert outcome.ranks and outcome.ranks[0].memory_budget_bytes == budget


def test_search_in_fresh_processes_per_probe(pool: GangPool) -> None:
    warm = wait(pool.start(config(), "benchmark"))
    budget = 3000 * 4 * 4 * 32 * 4
    cfg = config(
        num_heads=4,
        head_dim=32,
        warmup=0,
        iterations=1,
        memory_budget_bytes=budget,
        # two probes (the second in new processes) prove what a third would
        search={"start": 2048, "max": 4096, "granularity": 2048, "fresh_processes": True},
    )
    outcome = wait(pool.start(cfg, "max_seq_len"))
    assert outcome.status == "succeeded", outcome.error
    assert [(p.seq_len, p.outcome) for p in outcome.probes] == [(2048, "fit"), (4096, "oom")]
    assert outcome.answer_seq_len == 2048
    assert not {p.pid for p in outcome.placement} & {p.pid for p in warm.placement}


def test_a_rank_that_kills_itself_gets_its_peers_killed(pool: GangPool) -> None:
    """W=2 data-parallel run of `exit_on_rank` (tests/plugins): rank 1's process SIGKILLs
    itself in its first forward while rank 0 goes on into the run's collectives, where it would
    wait for its dead peer until the process group's timeout. The run fails as rank 1's, long
    before that timeout, and the gang kills rank 0 too: no rank actor or placement group is
    left (real Ray, real processes)."""
    cfg = config(kernel="exit_on_rank", world_size=2, batch_size=2, parallel="data")
    assert cfg.dist_timeout_s >= 60
    started = time.monotonic()
    handle = pool.start(cfg, "benchmark")
    with pytest.raises(RankFailed, match="rank 1 failed") as info:
        wait(handle, timeout_s=60)
    assert info.value.rank == 1
    assert_no_leaks()  # rank 0, blocked on its dead peer, was killed with the gang
    assert time.monotonic() - started < cfg.dist_timeout_s
