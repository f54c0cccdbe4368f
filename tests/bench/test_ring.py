"""bench/ring.py runs end to end on a tiny sequence: its correctness gate passes, twin and ring
alternate for every round, and the reported ratio is the median of the rounds' ratios."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ring_reports_rounds_and_memory():
    cmd = [sys.executable, "bench/ring.py", "--seq", "256", "--world", "2", "--mem-world", "2"]
    cmd += ["--repeats", "1", "--rounds", "2", "--cases", "causal-zigzag"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    case, memory = lines
    assert case["case"] == "causal-zigzag" and case["world"] == 2
    for key in ("fwd_s", "fwd_bwd_s"):
        ring, twin, ratios = case[f"{key}_ring"], case[f"{key}_twin"], case[f"{key}_ratios"]
        assert len(ring) == len(twin) == len(ratios) == 2 and min(ring + twin) > 0
        for r, t, got in zip(ring, twin, ratios, strict=True):
            assert got == pytest.approx(r / t, rel=0.01)
        assert case[f"{key}_ratio"] == pytest.approx(statistics.median(ratios), abs=0.002)
    assert len(case["peak_per_rank"]) == 2 and case["peak_twin"] > 0
    assert memory["world"] == 2 and len(memory["peak_per_rank"]) == 2
    worst = max(memory["peak_per_rank"]) / memory["peak_twin"]
    assert memory["ratio_worst_rank"] == pytest.approx(worst, abs=0.001)
