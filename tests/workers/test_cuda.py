"""The protocol on a CUDA device (skipped without one): events, allocator peak, emulated budget."""

from __future__ import annotations

import pytest
import torch
from _workers_helpers import config

from workers import protocol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_peak_is_the_allocator_peak_above_the_inputs() -> None:
    cfg = config(device="cuda", seq_len=8192, num_heads=8, head_dim=64)
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    tensor = 8192 * 8 * 64 * 4
    assert 4 * tensor <= case.result.peak_memory_bytes <= 8 * tensor
    assert all(t > 0 for t in case.result.times_s)
    assert case.environment.gpus and case.environment.cuda


def test_cuda_budget_turns_a_big_case_into_a_real_oom_and_the_rank_recovers() -> None:
    budget = 256 * 2**20
    big = config(
        device="cuda", seq_len=1 << 20, num_heads=8, head_dim=64, memory_budget_bytes=budget
    )  # 2 GiB per input
    case = protocol.run_case(big)
    assert case.status == "oom" and not case.emulated
    assert case.requested_bytes is not None and case.requested_bytes > 0
    small = protocol.run_case(config(device="cuda", memory_budget_bytes=budget))
    assert small.status == "ok", small.error


def test_a_cuda_oom_saves_the_failing_rank_memory_snapshot() -> None:
    import pickle

    budget = 256 * 2**20
    big = config(
        device="cuda", seq_len=1 << 20, num_heads=8, head_dim=64, memory_budget_bytes=budget
    )
    case = protocol.run_case(big)
    assert case.status == "oom"
    (snapshot,) = case.artifacts
    assert snapshot.name == "memory-snapshot-rank0.pickle" and snapshot.kind == "memory_snapshot"
    assert snapshot.data is not None and "segments" in pickle.loads(snapshot.data)


def test_ring_steps_on_cuda_are_timed_by_events() -> None:
    case = protocol.run_case(config(device="cuda", kernel="ring", seq_len=4096, mode="train"))
    assert case.status == "ok", case.error
    steps = case.result.steps
    assert steps and all(s.compute_s > 0 for s in steps)
    for i, t in enumerate(case.result.times_s):
        assert sum(s.compute_s + s.wait_s for s in steps if s.iteration == i) <= t * 1.01
