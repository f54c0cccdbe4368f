"""Files a rank produces for the researcher: a torch.profiler Chrome trace of the timed
iterations (`profile: true`) and, on CUDA, a memory snapshot of a rank that ran out of memory.

A rank returns them as bytes in its CaseOutcome (workers.results.Artifact); they travel to the
scheduler through Ray, and the scheduler alone writes them (service.artifacts). One larger than
MAX_ARTIFACT_BYTES is not shipped: it comes as a refusal that says its size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator

import torch

from workers.results import Artifact

log = logging.getLogger(__name__)

MAX_ARTIFACT_BYTES = 64 << 20
"""The most one artifact may carry through Ray (the service may cap lower)."""
HISTORY_ENTRIES = 10_000
"""Allocation events a profiled CUDA run's memory history keeps (the newest)."""


def from_file(path: str, name: str, kind: str, rank: int) -> Artifact:
    """The file at `path` as an artifact, or a refusal when it is over MAX_ARTIFACT_BYTES."""
    size = os.path.getsize(path)
    if size > MAX_ARTIFACT_BYTES:
        return Artifact(
            name=name,
            kind=kind,
            rank=rank,
            size_bytes=size,
            refused=f"{size} bytes is over the {MAX_ARTIFACT_BYTES}-byte limit of one artifact "
            "a rank sends; profile fewer iterations or a shorter sequence",
        )
    with open(path, "rb") as fh:
        data = fh.read()
    return Artifact(name=name, kind=kind, rank=rank, size_bytes=len(data), data=data)


@contextlib.contextmanager
def profiled(
    enabled: bool, device: torch.device, rank: int, into: list[Artifact]
) -> Iterator[None]:
    """Run the body under torch.profiler (CPU, and CUDA on a GPU) when `enabled`, and append its
    Chrome trace (trace-rank{rank}.json, opens in Perfetto or chrome://tracing) to `into`."""
    if not enabled:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    with tempfile.TemporaryDirectory(prefix="ringlab-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        into.append(from_file(path, f"trace-rank{rank}.json", "chrome_trace", rank))


@contextlib.contextmanager
def memory_history(enabled: bool, device: torch.device) -> Iterator[None]:
    """On CUDA and when `enabled` (a profiled run), record the allocator's recent history
    (Python stacks, HISTORY_ENTRIES events) during the body, so that an OOM's snapshot shows
    which allocations led to it. Off by default: recording costs every allocation time."""
    if not enabled or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def snapshot(device: torch.device, rank: int) -> list[Artifact]:
    """On CUDA, the allocator's memory snapshot (memory-snapshot-rank{rank}.pickle, for
    pytorch.org/memory_viz): every segment and block allocated now, and the recent history
    when `memory_history` records; on CPU none."""
    if device.type != "cuda":
        return []
    with tempfile.TemporaryDirectory(prefix="ringlab-snapshot-") as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        return [from_file(path, f"memory-snapshot-rank{rank}.pickle", "memory_snapshot", rank)]
