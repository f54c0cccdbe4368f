"""bench.gpu's maximum forward length under a memory budget, and its deliberate OOM (torch only).

A probe builds q, k, v at a length and runs one forward without a graph:
- on CUDA the budget is real: `torch.cuda.set_per_process_memory_fraction(budget / total)`, so
  a probe over it raises the allocator's OutOfMemoryError; its outcome is "oom" with the bytes
  the failing allocation asked for (from the error's "Tried to allocate" figure);
- on CPU nothing stops an allocation, so the budget is emulated: the probe's peak (the meter
  of bench.kernels, inputs included) over the budget is "over_budget", `emulated` true.
The search doubles from `start` while probes fit, then narrows the bracket between the last
fit and the first failure down to `granularity` tokens (lengths stay multiples of it): towards
the length where the line through the measured peaks meets the budget (the whole GPU's memory
without one), else by halving (workers.bracket, the service's rule).
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import attention
from bench.kernels import measure_peak
from workers.bracket import next_length
from workers.memory import PeakMeter

GTX_1080_BYTES = 8 * 2**30
"""The budget that emulates an 8 GB GTX 1080 on a larger GPU."""
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True)
class Probe:
    """One forward at `seq`: outcome "ok", "oom" (CUDA's allocator refused `requested_bytes`)
    or "over_budget" (CPU, emulated: its peak `requested_bytes` exceeds the budget)."""

    seq: int
    outcome: str
    requested_bytes: int | None = None
    emulated: bool = False
    peak_bytes: int | None = None
    """The forward's peak (CUDA: the allocator's; CPU: the process's, inputs included); None
    where an allocation failed."""


@dataclass
class Search:
    """A kernel's maximum forward length under `budget_bytes` and the probes that found it."""

    kernel: str
    params: dict[str, Any]
    budget_bytes: int
    max_seq: int | None = None
    probes: list[Probe] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return asdict(self)


def requested_bytes(error: BaseException) -> int | None:
    """The bytes an allocator error says it tried to allocate ("Tried to allocate 2.00 GiB")."""
    found = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", str(error))
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


@contextmanager
def cuda_budget(device: torch.device, budget_bytes: int | None) -> Iterator[None]:
    """The caching allocator capped at `budget_bytes` (None: the whole GPU) for the block."""
    if device.type != "cuda" or budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


def probe(
    kernel: str,
    params: dict[str, Any],
    seq: int,
    shape: tuple[int, int, torch.dtype],
    device: torch.device,
    budget_bytes: int | None,
) -> Probe:
    """One forward of `kernel` at `seq` with (heads, head_dim, dtype) inputs, batch 1."""
    heads, dim, dtype = shape
    module = attention.build(kernel, **params).to(device)

    def forward() -> torch.Tensor:
        q, k, v = (torch.randn(1, seq, heads, dim, device=device, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            return module(q, k, v)

    if device.type == "cuda":
        try:
            torch.cuda.reset_peak_memory_stats(device)
            out = forward()
            torch.cuda.synchronize(device)
            del out
            return Probe(seq, "ok", peak_bytes=torch.cuda.max_memory_allocated(device))
        except torch.OutOfMemoryError as error:
            asked = requested_bytes(error)
            del error  # its traceback holds the failed call's tensors
            gc.collect()
            torch.cuda.empty_cache()
            return Probe(seq, "oom", asked)
    peak = measure_peak(PeakMeter(device), forward)
    if budget_bytes is not None and peak > budget_bytes:
        return Probe(seq, "over_budget", peak, emulated=True, peak_bytes=peak)
    return Probe(seq, "ok", peak_bytes=peak)


def max_length(
    kernel: str,
    params: dict[str, Any],
    shape: tuple[int, int, torch.dtype],
    device: torch.device,
    budget_bytes: int | None,
    *,
    start: int,
    granularity: int,
    cap: int,
) -> Search:
    """The longest multiple of `granularity` up to `cap` whose forward fits (see the module)."""
    found = Search(kernel, params, budget_bytes or _device_bytes(device))
    good, bad, seq = 0, None, start
    with cuda_budget(device, budget_bytes):
        while bad is None and seq <= cap:
            result = probe(kernel, params, seq, shape, device, budget_bytes)
            found.probes.append(result)
            if result.outcome == "ok":
                good, seq = seq, seq * 2
            else:
                bad = seq
        if bad is None:
            bad = cap + granularity
        guesses = 0
        while bad - good > granularity:
            peaks = {p.seq: p.peak_bytes for p in found.probes if p.peak_bytes}
            target, guessed = next_length(
                good, bad, peaks, found.budget_bytes or None, granularity, guesses
            )
            guesses += guessed
            mid = target // granularity * granularity
            if mid in (good, bad):
                break
            result = probe(kernel, params, mid, shape, device, budget_bytes)
            found.probes.append(result)
            good, bad = (mid, bad) if result.outcome == "ok" else (good, mid)
    found.max_seq = good or None
    return found


def _device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return 0
