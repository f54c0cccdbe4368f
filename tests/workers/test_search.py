"""The max_seq_len search without Ray: doubling, bisection, divisibility rounding, probe records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _workers_helpers import config, planted_result

import attention
from attention.registry import KernelSpec
from workers.bracket import MAX_GUESSES, next_length
from workers.config import RunConfig
from workers.results import CaseOutcome
from workers.search import run_search, snap_down


def _planted(
    limit: int,
    log: list[int],
    peak_of: Callable[[int], int] = lambda n: 100 * n,
    oom_peak: bool = True,
) -> Any:
    """A probe runner whose ranks fit up to `limit` tokens, measuring `peak_of(length)` bytes
    (an OOM's too when `oom_peak`: CPU's emulated ones do, a real allocation failure does not)."""

    def run_probe(cfg: RunConfig, first: bool) -> list[CaseOutcome]:
        assert first == (not log)
        log.append(cfg.seq_len)
        peak = peak_of(cfg.seq_len)
        if cfg.seq_len > limit:
            return [
                CaseOutcome(
                    rank=0,
                    seq_len=cfg.seq_len,
                    status="oom",
                    emulated=oom_peak,
                    peak_memory_bytes=peak if oom_peak else None,
                    error="over budget",
                )
            ]
        result = planted_result(cfg.seq_len, 0.5, peak)
        return [
            CaseOutcome(
                rank=0, seq_len=cfg.seq_len, status="ok", result=result, peak_memory_bytes=peak
            )
        ]

    return run_probe


def test_doubling_then_bisection_to_the_granularity() -> None:
    cfg = config(search={"start": 1024, "max": 1 << 20, "granularity": 256})
    log: list[int] = []
    outcome = run_search(cfg, _planted(5000, log))
    assert outcome.status == "succeeded"
    assert log[:4] == [1024, 2048, 4096, 8192]
    assert outcome.answer_seq_len <= 5000 < outcome.answer_seq_len + 256
    assert [p.seq_len for p in outcome.probes] == log
    assert all((p.outcome == "fit") == (p.seq_len <= 5000) for p in outcome.probes)
    assert all(p.emulated for p in outcome.probes if p.outcome == "oom")
    assert outcome.probes[0].peak_memory_bytes == 102400 and outcome.probes[0].time_s == 0.5


def _closes_within(outcome: Any, limit: int, granularity: int) -> bool:
    """The answer fits and a probe at most `granularity` longer did not: the search's promise."""
    answer = outcome.answer_seq_len
    failed = [p.seq_len for p in outcome.probes if p.outcome == "oom"]
    return answer <= limit and any(answer < n <= answer + granularity for n in failed)


@pytest.mark.parametrize("oom_peak", [True, False], ids=["emulated-oom", "real-oom"])
def test_a_budget_closes_the_bracket_where_the_measured_peaks_predict(oom_peak: bool) -> None:
    """Peaks of 100 bytes a token under a 500,000-byte budget: after the first OOM (8192) the
    line through the peaks (the bracket's ends, or the two longest fits when the OOM measured
    nothing) says 5000; the search probes the last granule below it, then the one above it.
    Halving the same bracket takes four probes and lands on the same answer."""
    search = {"start": 1024, "max": 1 << 20, "granularity": 256}
    log: list[int] = []
    outcome = run_search(
        config(search=search, memory_budget_bytes=500_000), _planted(5000, log, oom_peak=oom_peak)
    )
    assert log == [1024, 2048, 4096, 8192, 4864, 5120]
    halving: list[int] = []
    plain = run_search(config(search=search), _planted(5000, halving, oom_peak=oom_peak))
    assert halving == [1024, 2048, 4096, 8192, 6144, 5120, 4608, 4864]
    assert outcome.answer_seq_len == plain.answer_seq_len == 4864
    assert _closes_within(outcome, 5000, 256)


@pytest.mark.parametrize(
    ("peak_of", "limit"),
    [
        (lambda n: n * n // 50, 7071),  # quadratic memory: the line undershoots every time
        (lambda n: 100 * n + 300_000, 5000),  # OOMs before the peaks say (fragmentation)
        (lambda n: 10**6 - n, 9000),  # falling peaks: no prediction at all
        (lambda n: 100 * n + (n % 3) * 40_000, 4321),  # noisy
    ],
    ids=["quadratic", "early-oom", "falling", "noisy"],
)
def test_wrong_predictions_still_find_the_longest_fit(
    peak_of: Callable[[int], int], limit: int
) -> None:
    """Memory that a line predicts badly costs probes, never the answer: it fits, a probe at
    most one granule longer did not, and at most MAX_GUESSES probes more than halving."""
    search = {"start": 1024, "max": 1 << 20, "granularity": 64}
    log: list[int] = []
    outcome = run_search(
        config(search=search, memory_budget_bytes=1_000_000), _planted(limit, log, peak_of)
    )
    assert outcome.status == "succeeded" and _closes_within(outcome, limit, 64), log
    halving: list[int] = []
    run_search(config(search=search), _planted(limit, halving, peak_of))
    assert len(log) <= len(halving) + MAX_GUESSES, (log, halving)


def test_predictions_are_capped_where_each_moves_the_bracket_a_granule() -> None:
    """A 1e9-byte peak at the first OOM bends the line so that every prediction is lo + one
    granule: after MAX_GUESSES of those the search only halves, instead of walking up a
    granule a probe."""
    search = {"start": 1024, "max": 1 << 20, "granularity": 64}
    log: list[int] = []
    steep = _planted(5000, log, lambda n: 100 * n if n <= 5000 else 10**9)
    outcome = run_search(config(search=search, memory_budget_bytes=500_000), steep)
    halving: list[int] = []
    run_search(config(search=search), _planted(5000, halving))
    assert log[4:7] == [4160, 4224, 4288]  # the three predictions, then halving
    assert _closes_within(outcome, 5000, 64) and len(log) <= len(halving) + MAX_GUESSES


def test_a_real_oom_predicts_from_the_two_longest_fits() -> None:
    """Quadratic peaks (n^2 / 50) under 600,000 bytes fit up to 5477 tokens; the OOMs measure
    nothing. The line through the two longest fits (2048 and 4096; not 1024) says 6248: the
    probe at 6144 fails, the middle 5120 fits, and two more predictions close it."""
    search = {"start": 1024, "max": 1 << 20, "granularity": 256}
    log: list[int] = []
    planted = _planted(5477, log, lambda n: n * n // 50, oom_peak=False)
    outcome = run_search(config(search=search, memory_budget_bytes=600_000), planted)
    assert log == [1024, 2048, 4096, 8192, 6144, 5120, 5376, 5632]
    assert outcome.answer_seq_len == 5376


def test_a_prediction_the_kernel_cannot_place_is_a_halving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel of whole 1024-token blocks, granularity 256: the predicted 4352 has no accepted
    length above 4096, so the search halves as it would without a budget (it does not jump to
    the far end of the bracket)."""
    kernel = _register_multiple_of(monkeypatch, 1024)
    search = {"start": 1024, "max": 1 << 20, "granularity": 256}
    log: list[int] = []
    cfg = config(kernel=kernel, seq_len=1024, search=search, memory_budget_bytes=450_000)
    outcome = run_search(cfg, _planted(4500, log))
    halving: list[int] = []
    run_search(config(kernel=kernel, seq_len=1024, search=search), _planted(4500, halving))
    assert log == halving == [1024, 2048, 4096, 8192, 6144, 5120]
    assert outcome.answer_seq_len == 4096


def test_next_length_predicts_inside_the_bracket_and_halves_otherwise() -> None:
    peaks = {4096: 409_600, 8192: 819_200}
    assert next_length(4096, 8192, peaks, 500_000, 256, 0) == (4864, True)
    assert next_length(4864, 8192, {**peaks, 4864: 486_400}, 500_000, 256, 1) == (5120, True)
    assert next_length(4096, 8192, peaks, 900_000, 256, 0) == (6144, False)  # beyond hi
    assert next_length(4096, 8192, peaks, None, 256, 0) == (6144, False)  # no budget
    assert next_length(4096, 8192, peaks, 500_000, 256, MAX_GUESSES) == (6144, False)
    assert next_length(4096, 8192, {4096: 409_600}, 500_000, 256, 0) == (6144, False)
    ends = {4096: 409_600, 8000: 800_000}  # a bracket that is no whole number of granules
    assert next_length(4096, 8000, ends, 790_000, 256, 0) == (7680, True)
    assert next_length(4096, 8000, ends, 805_000, 256, 0) == (6048, False)  # 8050: beyond hi
    # within one granule of hi, the step above lo would not be below hi: halve
    assert next_length(4096, 4200, {4096: 409_600, 4200: 420_000}, 415_000, 256, 0) == (
        4148,
        False,
    )


def test_max_caps_the_search() -> None:
    cfg = config(search={"start": 1024, "max": 3000, "granularity": 256})
    log: list[int] = []
    outcome = run_search(cfg, _planted(1 << 30, log))
    assert log == [1024, 2048, 3000] and outcome.answer_seq_len == 3000


def test_first_length_that_does_not_fit_is_an_oom() -> None:
    cfg = config(search={"start": 1024, "max": 4096, "granularity": 256})
    outcome = run_search(cfg, _planted(100, []))
    assert outcome.status == "oom" and outcome.answer_seq_len is None
    assert len(outcome.probes) == 1 and "1024 did not fit" in outcome.error


def _register_multiple_of(monkeypatch: pytest.MonkeyPatch, quantum: int) -> str:
    """dense with a divisibility rule: seq_len must be divisible by `quantum`."""

    def check(
        params: Any, *, seq_len: int, world_size: int = 1, num_heads: int = 1, causal: Any = None
    ) -> None:
        if seq_len % quantum:
            raise ValueError(f"seq_len: {seq_len} must be divisible by {quantum}")

    name = f"by{quantum}"
    base = attention.KERNELS["dense"]
    spec = KernelSpec(
        name=name, description="test", params=base.params, factory=base.factory, check=check
    )
    monkeypatch.setitem(attention.KERNELS, name, spec)
    return name


@pytest.fixture
def by_96(monkeypatch: pytest.MonkeyPatch) -> str:
    return _register_multiple_of(monkeypatch, 96)


@pytest.mark.parametrize(
    ("quantum", "limit", "granularity", "answer"),
    [
        (100, 7777, 100, 7700),  # a block size of 100: 25 * 4 is no f * 2**k step
        (100, 3333, 1, 3300),
        (96, 5000, 1, 4992),
        (11, 1000, 1, 990),  # a prime quantum
    ],
)
def test_search_lands_on_the_largest_accepted_length(
    monkeypatch: pytest.MonkeyPatch, quantum: int, limit: int, granularity: int, answer: int
) -> None:
    """Whatever the kernel's quantum, the answer is the largest accepted length that fits,
    not one that stopped a few steps short because a rounding rule could not reach it."""
    kernel = _register_multiple_of(monkeypatch, quantum)
    cfg = config(
        kernel=kernel,
        seq_len=quantum,
        search={"start": quantum * 10, "max": 1 << 20, "granularity": granularity},
    )
    log: list[int] = []
    outcome = run_search(cfg, _planted(limit, log))
    assert all(n % quantum == 0 for n in log)
    assert outcome.status == "succeeded" and outcome.answer_seq_len == answer, log


def test_probes_follow_the_kernels_divisibility_rule(by_96: str) -> None:
    cfg = config(
        kernel=by_96, seq_len=960, search={"start": 1000, "max": 1 << 20, "granularity": 100}
    )
    assert snap_down(cfg, 1000) == 960 and snap_down(cfg, 95) is None
    log: list[int] = []
    outcome = run_search(cfg, _planted(5000, log))
    assert all(n % 96 == 0 for n in log)
    assert log[0] == 960 and outcome.answer_seq_len <= 5000
    assert min(n for n in log if n > 5000) - outcome.answer_seq_len <= 192


def test_probe_error_stops_the_search() -> None:
    def broken(cfg: RunConfig, first: bool) -> list[CaseOutcome]:
        return [CaseOutcome(rank=0, seq_len=cfg.seq_len, status="failed", error="boom")]

    outcome = run_search(config(search={"start": 512, "max": 4096, "granularity": 256}), broken)
    assert outcome.status == "failed" and "rank 0: boom" in outcome.error
    assert [p.outcome for p in outcome.probes] == ["error"]


def test_a_model_search_grows_past_lengths_the_kernel_refuses() -> None:
    """From a predicted start the search grows by 1.125; where no accepted length lies that
    close (hilbert ordering: powers of 4 only) it takes the next accepted one instead of
    stopping at the start."""
    from workers.search import predicted_start

    params = {"segment_lengths": [256, 512], "dilation_rates": [1, 2], "ordering": "hilbert"}
    cfg = RunConfig.model_validate(
        {
            "workload": "model",
            "kernel": "dilated",
            "params": params,
            "seq_len": 1024,
            "device": "cpu",
            "memory_budget_bytes": 96 << 20,
            "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 4096},
            "search": {"start": 1024, "max": 1 << 16, "granularity": 512},
        }
    )
    start = predicted_start(cfg)
    assert start == 1024  # the prediction (~1.3K) snapped down to a power of 4
    log: list[int] = []
    outcome = run_search(cfg, _planted(8192, log))
    assert log[0] == start
    assert outcome.answer_seq_len == 4096
    assert log == [1024, 4096, 16384]  # nothing accepted in (1024, 2048]: the next power of 4
