"""The measurement harness every workload shares (workers.protocol's attention cases and
workers.training's model cases): the device, its timer and sync, the CUDA memory cap, the ring
link probe, percentiles, and a measured case's outcome under the memory budget.

It imports neither workload, so each imports it without a circle.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from workers import kernels
from workers.config import RunConfig
from workers.kernels import DTYPES
from workers.link import LinkFigures, probe_ring_link
from workers.memory import release
from workers.results import CaseOutcome, RankResult


def resolve_device(config: RunConfig) -> torch.device:
    """cuda when asked or available (auto), else cpu; Ray has already set CUDA_VISIBLE_DEVICES."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA device is visible to this rank")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def memory_fraction(device: torch.device, budget: int | None) -> Iterator[None]:
    """Cap the CUDA caching allocator at the budget (emulates a smaller GPU); CPU: no-op."""
    if device.type != "cuda" or budget is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call takes: CUDA events on GPU, perf_counter on CPU."""
    if device.type == "cuda":

        def timed_cuda(step: Callable[[], None]) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return timed_cuda

    def timed_cpu(step: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    return timed_cpu


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def timed_fields(times: list[float], tokens: int, flops: float) -> dict[str, Any]:
    """A RankResult's figures of its timed iterations: every time, their median, p10 and p90,
    and the tokens and FLOPs per second at the median (`tokens`, `flops`: per iteration)."""
    median = statistics.median(times)
    return {
        "times_s": times,
        "median_s": median,
        "p10_s": percentile(times, 0.1),
        "p90_s": percentile(times, 0.9),
        "tokens_per_s": tokens / median,
        "flops": flops,
        "flops_per_s": flops / median,
    }


def kv_block_bytes(config: RunConfig, tokens: int) -> int:
    """Bytes of this rank's k and v for `tokens` (batch rows x positions it holds): what one
    ring step sends on. A layer kernel gets k and v at num_heads (it projects them itself)."""
    elem = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    kv = config.num_heads if kernels.is_layer(config.kernel) else config.kv_heads
    return 2 * tokens * kv * config.head_dim * elem


def measure_link(config: RunConfig, device: torch.device, tokens: int) -> LinkFigures | None:
    """A sequence-parallel run over W > 1 ranks: this rank's link to its next ring neighbour,
    pinged with one K/V block (workers.link), before anything of the case is metered; its
    buffers are released before the meter's baseline. None for one rank or data parallelism
    (no ring). Every rank of the run calls it at the same point."""
    if kernels.shard_world(config) < 2:
        return None
    figures = probe_ring_link(kv_block_bytes(config, tokens), device)
    release()
    return figures


def link_fields(link: LinkFigures | None) -> dict[str, Any]:
    """The RankResult fields of a link measurement (None each without one)."""
    if link is None:
        return {"link_probe_bytes": None, "link_probe_bytes_per_s": None, "link_latency_s": None}
    return {
        "link_probe_bytes": link.probe_bytes,
        "link_probe_bytes_per_s": link.bytes_per_s,
        "link_latency_s": link.latency_s,
    }


def measured_case(
    case: dict[str, Any],
    result: RankResult,
    device: torch.device,
    timed: tuple[float, float],
) -> CaseOutcome:
    """A case that measured `result`: ok, or on CPU an emulated oom when its peak is over
    the memory budget (the measurement kept, flagged emulated_oom). `timed` holds the unix
    times of the first timed iteration's start and the last one's end."""
    timing = {"first_iteration_at": timed[0], "last_iteration_at": timed[1]}
    peak, budget = result.peak_memory_bytes, result.memory_budget_bytes
    if device.type == "cpu" and budget is not None and peak > budget:
        return CaseOutcome(
            **case,
            **timing,
            status="oom",
            emulated=True,
            peak_memory_bytes=peak,
            result=result.model_copy(update={"emulated_oom": True}),
            error=f"peak {peak} bytes over the {budget}-byte CPU memory budget",
        )
    return CaseOutcome(**case, **timing, status="ok", peak_memory_bytes=peak, result=result)
