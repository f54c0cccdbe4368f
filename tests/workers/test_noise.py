"""workers.noise: the median's order-statistic interval, the `iterations: auto` stopping rule,
ratio intervals, and a timed loop whose ranks all stop at the same iteration."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from _workers_helpers import config
from pydantic import ValidationError

from workers import noise, protocol
from workers.config import RunConfig

CPU = torch.device("cpu")


def _coverage(n: int, lo: int) -> float:
    """1 - 2 P(B <= lo - 1), B ~ Binomial(n, 1/2), summed here independently of the module."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(lo)) / 2**n


@pytest.mark.parametrize(("n", "lo"), [(6, 1), (9, 2), (10, 2), (20, 6), (50, 18), (100, 40)])
def test_median_rank_is_the_narrowest_interval_at_95_percent(n: int, lo: int) -> None:
    """The textbook ranks (e.g. n = 20: x_(6)..x_(15)); one rank narrower falls under 95%."""
    got, level = noise.median_rank(n)
    assert got == lo
    assert level == pytest.approx(_coverage(n, lo)) and level >= 0.95
    assert _coverage(n, lo + 1) < 0.95


def test_fewer_than_six_samples_have_no_95_percent_interval() -> None:
    """5 samples: [min, max] covers the median with 93.75% only, and says so; 1: nothing."""
    found = noise.median_interval([5.0, 1.0, 3.0, 2.0, 4.0])
    assert found == noise.Interval(1.0, 5.0, 0.9375)
    assert noise.median_interval([1.0]) is None
    assert not noise.settled([1.0] * 5)  # identical, but no 95% interval yet
    assert noise.settled([1.0] * 6)


def test_large_counts_use_the_normal_approximation_within_one_rank() -> None:
    exact, _ = noise._binomial_rank(1000, 0.95)
    assert abs(noise.median_rank(1001)[0] - exact) <= 1
    assert noise.median_rank(1001)[1] == pytest.approx(0.95, abs=0.01)


def test_settled_is_the_interval_within_three_percent() -> None:
    """20 samples: the interval is x_(6)..x_(15); the extremes do not matter, those two do."""
    base = [1.0] * 20
    wild = [0.1, 0.2, 0.3, 0.4, 0.5] + [1.0] * 10 + [5.0, 6.0, 7.0, 8.0, 9.0]
    assert noise.settled(base) and noise.settled(wild)
    spread = sorted([0.5] * 5 + [0.96] + [1.0] * 8 + [1.05] + [2.0] * 5)
    found = noise.median_interval(spread)
    assert found is not None and (found.lo, found.hi) == (0.96, 1.05)
    assert statistics.median(spread) == 1.0
    assert not noise.settled(spread)  # 1.05 is 5% above the median
    assert noise.settled(spread, tolerance=0.06)


def test_auto_vote_wants_more_until_settled_and_caps_by_time_and_count() -> None:
    rng = random.Random(0)
    noisy = [1.0 + rng.uniform(0, 1) for _ in range(30)]
    assert noise.auto_vote(noisy, elapsed_s=0.1, cap_s=2.0) == (True, False)
    assert noise.auto_vote(noisy, elapsed_s=2.5, cap_s=2.0) == (True, True)
    assert noise.auto_vote(noisy[:5], elapsed_s=9.0, cap_s=2.0) == (True, False)  # below 6
    many = noisy * 7  # 210 >= AUTO_MAX_ITERATIONS
    assert noise.auto_vote(many, elapsed_s=0.0, cap_s=2.0) == (True, True)
    assert noise.auto_vote([1.0] * 6, elapsed_s=0.0, cap_s=2.0) == (False, False)


def test_ratio_interval_takes_both_spreads() -> None:
    a = noise.Interval(1.8, 2.2, 0.96)
    b = noise.Interval(0.9, 1.1, 0.97)
    found = noise.ratio_interval(a, b)
    assert found == noise.Interval(
        pytest.approx(1.8 / 1.1), pytest.approx(2.2 / 0.9), pytest.approx(0.93)
    )
    assert not found.holds(1.0)
    assert noise.ratio_interval(b, b).holds(1.0)
    assert noise.ratio_interval(a, None) is None
    assert noise.inverse(b, 10.0) == noise.Interval(10 / 1.1, 10 / 0.9, 0.97)


def test_iterations_auto_is_the_default_and_an_int_means_exactly_that() -> None:
    cfg = RunConfig.model_validate({"kernel": "dense", "seq_len": 64})
    assert cfg.iterations == "auto" and cfg.time_cap_s is None
    fixed = noise.Iterations(3, None, 1, CPU)
    assert [fixed.more([0.0] * k) for k in range(5)] == [True, True, True, False, False]
    with pytest.raises(ValidationError, match="time_cap_s"):
        RunConfig.model_validate({"kernel": "dense", "seq_len": 64, "iterations": 4,
                                  "time_cap_s": 1.0})  # fmt: skip
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"kernel": "dense", "seq_len": 64, "iterations": "many"})


def test_iterations_auto_stops_by_the_rule_on_one_rank() -> None:
    """Feeding the loop: steady samples stop at 6; noisy ones run to the count cap."""
    steady = noise.Iterations("auto", 60.0, 1, CPU)
    times: list[float] = []
    while steady.more(times):
        times.append(1.0)
    assert len(times) == noise.AUTO_MIN_ITERATIONS
    rng = random.Random(1)
    noisy = noise.Iterations("auto", 60.0, 1, CPU)
    times = []
    while noisy.more(times):
        times.append(rng.uniform(1.0, 3.0))
    assert len(times) == noise.AUTO_MAX_ITERATIONS


def test_a_real_case_under_auto_stops_by_the_rule_or_the_cap() -> None:
    """run_case at a tiny shape: its count is the first one the rule allows for its own
    times (settled, or past the time cap, or the count cap), never before."""
    cfg = config(seq_len=256, iterations="auto", time_cap_s=0.5)
    case = protocol.run_case(cfg)
    times = case.result.times_s
    n = len(times)
    assert noise.AUTO_MIN_ITERATIONS <= n <= noise.AUTO_MAX_ITERATIONS
    assert all(not noise.settled(times[:k]) for k in range(noise.AUTO_MIN_ITERATIONS, n))
    wall = case.last_iteration_at - case.first_iteration_at
    assert noise.settled(times) or n == noise.AUTO_MAX_ITERATIONS or wall >= 0.5


def _votes_on_rank(rank: int, world: int, cap0: float) -> int:
    """Rank 0 settles at once (its time cap `cap0`), rank 1 is noisy (cap 60 s)."""
    import torch.distributed as dist

    count = noise.Iterations("auto", 60.0 if rank else cap0, world, CPU)
    rng = random.Random(rank)
    times: list[float] = []
    count.start()
    while count.more(times):
        dist.barrier()
        times.append(1.0 if rank == 0 else rng.uniform(1.0, 3.0))
    return len(times)


def _case_on_rank(rank: int, world: int) -> int:
    cfg = config(seq_len=256, world_size=world, kernel="ring", iterations="auto", time_cap_s=0.3)
    case = protocol.run_case(cfg, rank)
    assert case.status == "ok", case.error
    return len(case.result.times_s)


def test_ranks_of_a_gloo_group_run_the_same_count() -> None:
    """Rank 0 settles at 6, rank 1 wants more: both go on to rank 1's count cap; with rank 0
    past its time cap both stop at 6. A real ring case under auto: both ranks' times_s have
    one length."""
    from _dist_helpers import run_ranks

    assert run_ranks(_votes_on_rank, 2, 60.0) == [noise.AUTO_MAX_ITERATIONS] * 2
    assert run_ranks(_votes_on_rank, 2, 1e-9) == [noise.AUTO_MIN_ITERATIONS] * 2
    counts = run_ranks(_case_on_rank, 2)
    assert counts[0] == counts[1] and counts[0] >= noise.AUTO_MIN_ITERATIONS


def test_a_model_cell_under_auto_stops_by_the_same_rule() -> None:
    """workload: model: the timed steps follow Iterations too (its times are whole steps)."""
    from test_model_workload import model_cell

    cfg = RunConfig.model_validate(model_cell(iterations="auto", time_cap_s=0.3))
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    times = case.result.times_s
    assert noise.AUTO_MIN_ITERATIONS <= len(times) <= noise.AUTO_MAX_ITERATIONS
    assert all(not noise.settled(times[:k]) for k in range(noise.AUTO_MIN_ITERATIONS, len(times)))
    wall = case.last_iteration_at - case.first_iteration_at
    assert noise.settled(times) or wall >= 0.3 or len(times) == noise.AUTO_MAX_ITERATIONS
