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
