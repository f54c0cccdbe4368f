"""The step clock's thread CPU time (attention.ring.steps, thread_time=True): what a step
computed, apart from what the scheduler took from it."""

from __future__ import annotations

import time

import pytest
import torch

from attention.ring.steps import StepClock


def test_the_clock_counts_a_preempted_step_in_wall_time_only() -> None:
    """A step that loses the CPU (here: sleeps) grows in wall time, not in thread CPU time;
    one that computes grows in both; time waited is neither step's compute."""
    c = StepClock()
    c.start(torch.device("cpu"), thread_time=True)
    with c.step("forward", 0):
        time.sleep(0.2)
    with c.step("forward", 1):
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        with c.waiting():
            end = time.thread_time() + 0.1
            while time.thread_time() < end:
                pass
    slept, busy = c.collect()
    assert slept["compute_s"] >= 0.2 and slept["compute_thread_s"] < 0.05
    assert busy["compute_thread_s"] == pytest.approx(0.1, abs=0.03)
    assert busy["wait_s"] >= 0.1 and busy["compute_s"] >= 0.1
    with pytest.raises(ValueError, match="thread_time"):
        c.start(torch.device("cuda"), thread_time=True)
    c.start(torch.device("cpu"))
    with c.step("forward", 0):
        pass
    assert "compute_thread_s" not in c.collect()[0]
