"""The protocol on a CUDA device (skipped without one): events, allocator peak, emulated budget.

Runnable on a GPU machine without the service's packages (scripts/device_check.sh runs it with
`pytest --noconftest`): it imports workers.protocol and workers.config alone, no Ray, no
SQLAlchemy (so not tests/_workers_helpers.py, which reaches both).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from workers import protocol
from workers.config import RunConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = {"num_heads": 2, "head_dim": 16, "warmup": 1, "iterations": 3}


def config(**fields: Any) -> RunConfig:
    """A small run config (dense, 512 tokens, _workers_helpers.config's shape) with `fields`."""
    base: dict[str, Any] = {"kernel": "dense", "seq_len": 512, **SMALL}
    return RunConfig.model_validate({**base, **fields})


BUDGET = 256 * 2**20
CASES = {
    "peak": config(device="cuda", seq_len=8192, num_heads=8, head_dim=64),
    # 2 GiB per input; ungated: it measures the OOM, not the kernel (the gate, which no budget
    # caps, would first run the whole dense fp32 attention at 2^20 tokens: 14 GiB, tens of s)
    "oom": config(
        device="cuda", seq_len=1 << 20, num_heads=8, head_dim=64, memory_budget_bytes=BUDGET,
        correctness_check=False,
    ),
    "small under the budget": config(device="cuda", memory_budget_bytes=BUDGET),
    "ring": config(device="cuda", kernel="ring", seq_len=4096, mode="train"),
}  # fmt: skip
"""Every case the tests run, each named where it runs (scripts/device_plan.py budgets each
case once per use in this file)."""


@pytest.fixture
def one_rank_nccl() -> Iterator[None]:
    """A process group of this process alone on NCCL: a ring kernel runs at W = 1 in it."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_cuda_peak_is_the_allocator_peak_above_the_inputs() -> None:
    case = protocol.run_case(CASES["peak"])
    assert case.status == "ok", case.error
    tensor = 8192 * 8 * 64 * 4
    assert 4 * tensor <= case.result.peak_memory_bytes <= 8 * tensor
    assert all(t > 0 for t in case.result.times_s)
    assert case.environment.gpus and case.environment.cuda


def test_cuda_budget_turns_a_big_case_into_a_real_oom_and_the_rank_recovers() -> None:
    case = protocol.run_case(CASES["oom"])
    assert case.status == "oom" and not case.emulated
    assert case.requested_bytes is not None and case.requested_bytes > 0
    small = protocol.run_case(CASES["small under the budget"])
    assert small.status == "ok", small.error


def test_a_cuda_oom_saves_the_failing_rank_memory_snapshot() -> None:
    case = protocol.run_case(CASES["oom"])
    assert case.status == "oom"
    (snapshot,) = case.artifacts
    assert snapshot.name == "memory-snapshot-rank0.pickle" and snapshot.kind == "memory_snapshot"
    assert snapshot.data is not None and "segments" in pickle.loads(snapshot.data)


@pytest.mark.usefixtures("one_rank_nccl")
def test_ring_steps_on_cuda_are_timed_by_events() -> None:
    case = protocol.run_case(CASES["ring"])
    assert case.status == "ok", case.error
    steps = case.result.steps
    assert steps and all(s.compute_s > 0 for s in steps)
    for i, t in enumerate(case.result.times_s):
        assert sum(s.compute_s + s.wait_s for s in steps if s.iteration == i) <= t * 1.01
