"""The benchmark protocol: one case on one rank, torch only (no Ray), honest about time and memory.

`run_case(config, rank)` makes seeded inputs on the device (this rank's shard only), warms up,
times every iteration, measures the peak above the pre-input baseline (over the case's first
iteration; on CPU the later ones run on a heap that keeps freed memory, see `_timed_loop`),
applies the memory budget, and turns an allocation failure into status `oom`; the rank stays
usable. A sequence-parallel run over W > 1 ranks first measures its ring link (`measure_link`,
workers.link), before the inputs exist and outside the memory meter.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from attention.ring.steps import clock
from workers import kernels, references
from workers.artifacts import memory_history, profiled, snapshot
from workers.config import RunConfig
from workers.environment import collect
from workers.kernels import DTYPES
from workers.link import LinkFigures, probe_ring_link
from workers.memory import (
    PeakMeter,
    heap_keeps_freed,
    is_oom,
    on_metering_thread,
    release,
    requested_bytes,
)
from workers.results import Artifact, CaseOutcome, RankResult, StepTime, step_totals

# Max abs error allowed by the correctness check, against a float64 reference
# (references.REFERENCE_DTYPE).
CHECK_ATOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
CHECK_MIN_LEN = 128  # the check runs at the smallest valid length >= this (or seq_len if smaller)
PRIME_MIN_LEN = 1024
"""The warm-up run (_prime) runs at the smallest valid length >= this (or seq_len if smaller).
Shorter, the CPU ops run inline, and the case's first parallel region would fault in its thread
team's memory inside the metered iteration: measured, block_sparse at 8K tokens (h4 d32) read
1.7 MB more in a process primed at 128 tokens, nothing more primed at 1024."""
BLOCK = 1024  # inputs are generated in blocks of this many positions, each with its own seed
TENSORS = {"q": 0, "k": 1, "v": 2, "dout": 3}


def resolve_device(config: RunConfig) -> torch.device:
    """cuda when asked or available (auto), else cpu; Ray has already set CUDA_VISIBLE_DEVICES."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA device is visible to this rank")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_input(
    which: str,
    config: RunConfig,
    seq_len: int,
    positions: torch.Tensor,
    rows: slice,
    device: torch.device,
) -> torch.Tensor:
    """This rank's part of one global (batch, seq, heads, dim) tensor, built block by block.

    Every block of BLOCK positions has its own seed, so a rank materializes only the rows and
    positions it holds, and the global tensor is the same at every world size and layout.
    A layer kernel (kernels.is_layer) gets the same values as (batch, seq, embed_dim), embed_dim
    = heads x dim: a view of the same memory, so inputs and input bytes match the heads layout.
    """
    dtype = DTYPES[config.dtype]
    grouped = which in ("k", "v") and not kernels.is_layer(config.kernel)  # a layer projects
    h = config.kv_heads if grouped else config.num_heads
    d = config.head_dim
    n_rows = len(range(config.batch_size)[rows])
    out = torch.empty(n_rows, positions.numel(), h, d, device=device, dtype=dtype)
    sorted_pos, order = positions.sort()
    gen = torch.Generator(device=device)
    for block in range(math.ceil(seq_len / BLOCK)):
        lo_pos, hi_pos = block * BLOCK, min(seq_len, (block + 1) * BLOCK)
        lo = int(torch.searchsorted(sorted_pos, lo_pos))
        hi = int(torch.searchsorted(sorted_pos, hi_pos))
        if lo == hi:
            continue
        gen.manual_seed(((config.seed * 4 + TENSORS[which]) << 32) + block)
        shape = (config.batch_size, hi_pos - lo_pos, h, d)
        values = torch.randn(shape, generator=gen, device=device, dtype=dtype)[rows]
        src = (sorted_pos[lo:hi] - lo_pos).to(device)
        out[:, order[lo:hi].to(device)] = values[:, src]
        del values
    return out.flatten(2) if kernels.is_layer(config.kernel) else out


def _rows(config: RunConfig, rank: int) -> slice:
    if config.parallel == "data":
        lb = config.local_batch
        return slice(rank * lb, (rank + 1) * lb)
    return slice(None)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
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


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _error_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _timed_loop(
    module: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    config: RunConfig,
    meter: PeakMeter | None,
    device: torch.device,
    record_steps: bool = True,
) -> tuple[list[float], float, float, list[StepTime], int]:
    """Warm-up, then every timed iteration (barrier before each); returns (times, t0, t1,
    steps, peak): `steps` are the ring steps of every timed iteration (attention.ring.steps;
    none for a kernel without a ring, or when `record_steps` is off); `peak` the meter's (0
    without one).

    The peak meter is reset once the inputs exist and read after the case's first iteration
    (the first warm-up one, else the first timed one): every iteration computes the same, and
    on CPU the ones after it run on a heap that keeps freed memory for reuse
    (workers.memory.heap_keeps_freed), as a user's process does. On the meter's heap every
    fresh allocation pays its page faults, which charged kernels of many primitive calls
    (block_sparse at block 64: about 10% of its forward time); a kept heap cannot be metered.
    On CPU the first iteration runs on the metering thread (workers.memory.on_metering_thread),
    whose malloc arena the kept heaps of earlier cases never touched.
    """
    train = config.mode == "train"
    world = config.world_size
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    if train:
        for t in (q, k, v):
            t.requires_grad_(True)

    def step() -> None:
        if train:
            out = module(q, k, v, causal=config.causal)
            out.backward(inputs["dout"])
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                out = module(q, k, v, causal=config.causal)
        del out

    def first_step() -> None:
        """The case's first iteration: on CPU on the metering thread (see above)."""
        if device.type == "cpu":
            on_metering_thread(step)
        else:
            step()

    timer = _timer(device)
    peak = 0
    _barrier(world)
    if meter is not None:
        meter.reset()
    with contextlib.ExitStack() as heap:

        def first_done() -> None:
            """The case's first iteration is over: read the peak; on CPU keep freed memory."""
            nonlocal peak
            if meter is not None:
                peak = meter.peak()
            if device.type == "cpu":
                heap.enter_context(heap_keeps_freed())

        for i in range(config.warmup):
            _barrier(world)
            if i == 0:
                first_step()
                first_done()
            else:
                step()
        _sync(device)
        times: list[float] = []
        steps: list[StepTime] = []
        first_at = time.time()
        if record_steps:
            clock.start(device)
        try:
            for i in range(config.iterations):
                _barrier(world)
                first = i == 0 and config.warmup == 0
                times.append(timer(first_step if first else step))  # synchronized: CUDA events done
                steps += [StepTime(iteration=i, **row) for row in clock.collect()]
                if first:
                    first_done()
        finally:
            clock.stop()
    return times, first_at, time.time(), steps, peak


_PRIMED: set[str] = set()


def _prime(config: RunConfig, rank: int, device: torch.device) -> None:
    """Run the kernel once at a small length, once per process and case shape, so that lazy
    one-time allocations (thread pools, library workspaces) are not counted in a case's peak.
    """
    key = config.model_dump_json(include={"kernel", "params", "dtype", "mode", "causal"})
    key += f"{device}|{config.world_size}|{config.parallel}"
    if key in _PRIMED:
        return
    small = config.model_copy(update={"seq_len": check_length(config, PRIME_MIN_LEN)})
    sworld = kernels.shard_world(config)
    module = kernels.build(small, device)
    positions = kernels.local_positions(
        module, small, small.seq_len, rank if sworld > 1 else 0, sworld
    )
    names = ["q", "k", "v", "dout"] if config.mode == "train" else ["q", "k", "v"]
    rows = _rows(config, rank)
    inputs = {n: make_input(n, small, small.seq_len, positions, rows, device) for n in names}
    quiet = small.model_copy(update={"warmup": 0, "iterations": 1})
    _timed_loop(module, inputs, quiet, None, device, record_steps=False)
    _sync(device)
    del inputs, module
    release()
    _PRIMED.add(key)


def _oom_outcome(case: dict[str, Any], message: str) -> CaseOutcome:
    """A caught allocation failure (timed loop, priming, correctness check): an oom case, its
    memory given back first so the rank stays usable."""
    release(collect_cycles=True)
    return CaseOutcome(
        **case, status="oom", error=message, requested_bytes=requested_bytes(message)
    )


def run_case(config: RunConfig, rank: int = 0, kind: str = "benchmark") -> CaseOutcome:
    """Run one case as `rank` of config.world_size and return what it measured.

    Status ok, oom (a caught allocation failure, or on CPU a peak over the memory budget,
    flagged emulated) or failed (the correctness check). With world_size > 1 the process group
    must be initialized (the gang does it). kind `correctness` checks at the full length.
    """
    world = config.world_size
    if world > 1 and not dist.is_initialized():
        raise RuntimeError(f"world_size={world} needs an initialized process group")
    kernels.check_mode(config)
    device = resolve_device(config)
    environment = collect(device)
    case = {"rank": rank, "seq_len": config.seq_len, "environment": environment}

    budget = config.memory_budget_bytes
    max_abs_error = None
    checked_at = None
    if kernels.gated(config, kind):
        length = config.seq_len if kind == "correctness" else check_length(config)
        checked_at = length
        try:
            with memory_fraction(device, budget):
                max_abs_error = check_correctness(config, rank, device, length)
        except Exception as exc:
            if not is_oom(exc):
                raise
            where = f"the correctness check at seq_len {length}"
            return _oom_outcome(case, f"{where} ran out of memory: {_error_line(exc)}")
        tol = CHECK_ATOL[config.dtype]
        if not max_abs_error <= tol:  # also catches NaN
            return CaseOutcome(
                **case,
                status="failed",
                error=f"correctness check failed: max abs error {max_abs_error:.3g} at "
                f"seq_len {length} exceeds {tol:g} ({config.kernel} vs "
                f"{references.describe(config.kernel, config.params)}, {config.dtype}, "
                f"{config.mode})",
            )

    if config.workload == "model":
        from workers.training import run_model_case

        outcome = run_model_case(config, rank, case)
        if outcome.result is not None and max_abs_error is not None:
            checked = {"max_abs_error": max_abs_error, "check_seq_len": checked_at}
            outcome = outcome.model_copy(
                update={"result": outcome.result.model_copy(update=checked)}
            )
        return outcome

    sworld = kernels.shard_world(config)
    srank = rank if sworld > 1 else 0
    module = kernels.build(config, device)
    positions = kernels.local_positions(module, config, config.seq_len, srank, sworld)
    rows = _rows(config, rank)
    train = config.mode == "train"
    tokens = config.local_batch * positions.numel()

    elem = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    heads = (2 if train else 1) * config.num_heads  # q (and dout)
    input_bytes = tokens * heads * config.head_dim * elem + kv_block_bytes(config, tokens)
    if device.type == "cpu" and budget is not None and input_bytes > budget:
        # The inputs alone exceed the budget, so would the peak: do not allocate them.
        return CaseOutcome(
            **case,
            status="oom",
            emulated=True,
            requested_bytes=input_bytes,
            error=f"inputs need {input_bytes} bytes, over the {budget}-byte CPU memory budget",
        )

    stage = "the warm-up run at a short length"
    try:
        with memory_fraction(device, budget):
            _prime(config, rank, device)
            stage = "the link probe (one K/V block, before the inputs)"
            link = measure_link(config, device, tokens)
    except Exception as exc:
        if not is_oom(exc):
            raise
        return _oom_outcome(case, f"{stage} ran out of memory: {_error_line(exc)}")
    meter = PeakMeter(device)
    meter.baseline()
    names = ["q", "k", "v", "dout"] if train else ["q", "k", "v"]
    inputs: dict[str, torch.Tensor] = {}
    artifacts: list[Artifact] = []
    try:
        with memory_history(config.profile, device), memory_fraction(device, budget):
            try:
                for name in names:
                    inputs[name] = make_input(name, config, config.seq_len, positions, rows, device)
                resident_inputs = meter.current()
                with profiled(config.profile, device, rank, artifacts):
                    times, first_at, last_at, steps, peak = _timed_loop(
                        module, inputs, config, meter, device
                    )
                backend = kernels.backend_of(module)
            except Exception as exc:
                if is_oom(exc):  # the failing rank's allocations, its inputs still held
                    artifacts += snapshot(device, rank)
                raise
    except Exception as exc:
        if not is_oom(exc):
            raise
        message = _error_line(exc)
        del exc
        inputs.clear()
        oom = _oom_outcome(case, message)
        return oom.model_copy(update={"artifacts": artifacts})
    finally:
        inputs.clear()
        release()

    flops = kernels.flops(module, config, config.local_batch, positions.numel(), train)
    median = statistics.median(times)
    result = RankResult(
        rank=rank,
        seq_len=config.seq_len,
        times_s=times,
        median_s=median,
        p10_s=percentile(times, 0.1),
        p90_s=percentile(times, 0.9),
        tokens_per_s=tokens / median,
        flops=flops,
        flops_per_s=flops / median,
        peak_memory_bytes=peak,
        input_memory_bytes=resident_inputs,
        memory_budget_bytes=budget,
        backend=backend,
        max_abs_error=max_abs_error,
        check_seq_len=checked_at,
        steps=steps,
        **step_totals(steps),
        **link_fields(link),
    )
    measured = measured_case(case, result, device, (first_at, last_at))
    return measured.model_copy(update={"artifacts": artifacts})


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


def check_length(config: RunConfig, minimum: int = CHECK_MIN_LEN) -> int:
    """The reduced length of the correctness check: the smallest divisor of seq_len that is
    >= `minimum` (CHECK_MIN_LEN; the warm-up run's: PRIME_MIN_LEN) and that the kernel accepts
    (seq_len itself when none is smaller).
    """
    n = config.seq_len
    if n <= minimum:
        return n
    divisors = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            divisors.update((d, n // d))
    for length in sorted(d for d in divisors if d >= minimum):
        if kernels.is_valid_length(config, length):
            return length
    return n


def check_correctness(config: RunConfig, rank: int, device: torch.device, length: int) -> float:
    """Max abs error of the kernel at `length` against its float64 reference (output, and grads
    in train mode); the maximum over all ranks.

    A layer kernel's reference holds a float64 copy of the built module's weights
    (references.layer_reference); other kernels' references need only their params.
    """
    small = config.model_copy(update={"seq_len": length})
    module = kernels.build(small, device)
    if kernels.is_layer(config.kernel):
        reference = references.layer_reference(module)
    else:
        reference = references.reference_for(config.kernel, config.params)
    return max_error(small, module, reference, rank, device)


def max_error(
    config: RunConfig,
    module: torch.nn.Module,
    reference: references.Reference,
    rank: int,
    device: torch.device,
) -> float:
    """Max abs difference of `module` and `reference` at config.seq_len on the seeded inputs:
    output, and in train mode the gradients of q, k and v; the maximum over all ranks."""
    length = config.seq_len
    sworld = kernels.shard_world(config)
    srank = rank if sworld > 1 else 0
    rows = _rows(config, rank)
    full_pos = torch.arange(length)
    local_pos = kernels.local_positions(module, config, length, srank, sworld).to(device)
    train = config.mode == "train"
    names = ["q", "k", "v", "dout"] if train else ["q", "k", "v"]
    full = {n: make_input(n, config, length, full_pos, rows, device) for n in names}
    grads = train  # a forward-mode check compares outputs only (some kernels have no backward)
    ref = {
        n: t.to(references.REFERENCE_DTYPE).requires_grad_(grads and n != "dout")
        for n, t in full.items()
    }
    loc = {
        n: t[:, local_pos].detach().requires_grad_(grads and n != "dout") for n, t in full.items()
    }

    ref_out = reference(ref["q"], ref["k"], ref["v"], config.causal)
    out = module(loc["q"], loc["k"], loc["v"], causal=config.causal)
    errors = [(out.to(ref_out.dtype) - ref_out.detach()[:, local_pos]).abs().max()]
    if train:
        ref_out.backward(ref["dout"])
        out.backward(loc["dout"])
        for n in ("q", "k", "v"):
            ref_grad = ref[n].grad[:, local_pos]
            errors.append((loc[n].grad.to(ref_grad.dtype) - ref_grad).abs().max())
    error = torch.stack(errors).max().detach().to(device)
    if config.world_size > 1:
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return float(error)
