"""The CPU meter's heap setting and the timing heap, read off the kernel's page-fault count and
the resident set: a peak is metered with every tensor in its own mapping (each fresh one
faults its pages in); bench timings run where freed memory is reused (no faults once warm),
and leaving that heap restores the meter's setting and gives the kept memory back.

Run in a fresh interpreter: what earlier tests left in this process's heap would decide
which allocations reuse a free chunk."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, resource
from pathlib import Path
import torch
from workers.memory import heap_follows_tensors, heap_keeps_freed

MIB = 2**20

def faults(rounds=16, nbytes=MIB):
    # minor page faults of `rounds` fresh tensors, each touched, then freed
    for _ in range(16):  # warm: glibc settles on a chunk to reuse (about 10 rounds here)
        torch.ones(nbytes, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.ones(nbytes, dtype=torch.uint8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss():
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(x for x in lines if x.startswith("VmRSS")).split()[1]) * 1024

heap_follows_tensors()
out = {"meter": faults()}
with heap_keeps_freed():
    out["timing"] = faults()
    kept = [torch.ones(MIB, dtype=torch.uint8) for _ in range(24)]
    before_free = rss()
    del kept
    out["kept_mib"] = (rss() - before_free) / MIB  # freed but still resident
out["after_exit_mib"] = (before_free - rss()) / MIB  # given back on exit
# larger than any chunk freed in the heap above (a freed chunk that fits is reused either way)
out["restored"] = faults(rounds=4, nbytes=28 * MIB)
print(json.dumps(out))
"""


def test_the_meter_faults_every_tensor_in_and_the_timing_heap_reuses_freed_memory() -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    seen = json.loads(run.stdout)
    pages = 16 * 2**20 // 4096  # 16 tensors of 1 MiB
    assert seen["meter"] >= 0.9 * pages, seen  # each tensor mapped and faulted in afresh
    assert seen["timing"] <= 0.1 * pages, seen  # reused, already resident
    assert seen["kept_mib"] > -4, seen  # freed within the timing heap: kept
    assert seen["after_exit_mib"] >= 20, seen  # leaving it gives the 24 MiB back
    assert seen["restored"] >= 0.9 * 4 * 28 * 2**20 // 4096, seen  # the meter's setting is back


LOOP = r"""
import json, resource
import torch
from workers.config import RunConfig
from workers.memory import PeakMeter
from workers.protocol import _timed_loop

class Probe(torch.nn.Module):
    # each call: 16 fresh 1 MiB tensors, touched then freed; its minor page faults recorded
    def __init__(self):
        super().__init__()
        self.faults = []

    def forward(self, q, k, v, causal=False):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(16):
            torch.ones(2**20, dtype=torch.uint8)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return q.clone()

out = {}
for warmup in (1, 0):
    cfg = RunConfig.model_validate({"kernel": "dense", "seq_len": 64, "num_heads": 1,
        "head_dim": 8, "device": "cpu", "warmup": warmup, "iterations": 5})
    meter = PeakMeter(torch.device("cpu"))
    meter.baseline()
    x = torch.randn(1, 64, 1, 8)
    probe = Probe()
    times, _, _, _, peak = _timed_loop(probe, {"q": x, "k": x, "v": x}, cfg, meter, x.device)
    out[warmup] = {"faults": probe.faults, "peak": peak, "timed": len(times)}
print(json.dumps(out))
"""


def test_the_protocol_meters_the_first_iteration_and_times_the_rest_on_the_keeping_heap() -> None:
    """workers.protocol's loop: the case's first iteration (the warm-up, else the first timed
    one) runs on the meter's heap, every fresh tensor faulted in, and the peak is read there;
    the iterations after it run under heap_keeps_freed, so a kernel of many block-sized
    temporaries is not charged their page faults in the times the service publishes."""
    run = subprocess.run(
        [sys.executable, "-c", LOOP], capture_output=True, text=True, check=True, timeout=120
    )
    seen = json.loads(run.stdout)
    pages = 16 * 2**20 // 4096
    for warmup, case in seen.items():
        faults = case["faults"]
        assert len(faults) == 5 + int(warmup) and case["timed"] == 5, case
        assert faults[0] >= 0.9 * pages, case  # metered: each tensor mapped afresh
        assert 2**19 <= case["peak"] < 8 * 2**20, case  # about one 1 MiB tensor at a time
        assert max(faults[-2:]) <= 0.1 * pages, case  # timed on a heap that reuses them
