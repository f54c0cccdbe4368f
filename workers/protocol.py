"""The benchmark protocol: one case on one rank, torch only (no Ray), honest about time and memory.

`run_case(config, rank)` makes seeded inputs on the device (this rank's shard only), warms up,
times every iteration, measures the peak above the pre-input baseline (over the case's first
iteration, see `_timed_loop`; on CPU the CPU allocator's bytes, workers.memory.PeakMeter),
applies the memory budget, and turns an allocation failure into status `oom`; the rank stays
usable. A sequence-parallel run over W > 1 ranks first measures its ring link (`measure_link`,
workers.link), before the inputs exist and outside the memory meter.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import attention
from attention import compiled
from attention.ring.comm import AbortScope, PeerAborted, abort_scope, group_broken, wait_all
from attention.ring.steps import clock
from workers import kernels, references
from workers.artifacts import memory_history, profiled, snapshot
from workers.config import RunConfig
from workers.environment import collect
from workers.errors import error_text
from workers.gate import CheckOutOfMemory, GateResult, run_gate
from workers.harness import (
    kv_block_bytes,
    link_fields,
    measure_link,
    measured_case,
    memory_fraction,
    percentile,
    resolve_device,
    sync,
    timed_fields,
    timer,
)
from workers.inputs import batch_rows, make_input, shorter_length
from workers.kernels import DTYPES
from workers.link import LinkFigures
from workers.memory import PeakMeter, is_oom, release, requested_bytes
from workers.noise import Iterations
from workers.results import Artifact, CaseOutcome, RankResult, StepTime, step_totals
from workers.training import run_model_case

PRIME_MIN_LEN = 1024
"""The warm-up run (_prime) of a kernel that compiles nothing runs at the smallest valid length
>= this (or seq_len if smaller); a compiled plan's runs at the run's own length.
Shorter, the CPU ops run inline, and the case's first parallel region would fault in its thread
team's memory inside the metered iteration: measured with the resident-set meter, block_sparse
at 8K tokens (h4 d32) read 1.7 MB more in a process primed at 128 tokens, nothing more primed
at 1024 (that memory is not the allocator's: it now shows in the resident figure only)."""


def _barrier(world: int) -> None:
    """All ranks meet (inside a ring abort scope: a peer's abort flag ends the wait)."""
    if world > 1:
        wait_all([dist.barrier(async_op=True)])


@contextlib.contextmanager
def _ring_scope(world: int) -> Iterator[AbortScope | None]:
    """The timed loop's abort scope at W > 1 (attention.ring.comm.abort_scope): a rank that
    raises there, out of memory above all, flags it, and its waiting peers stop within
    ABORT_POLL_S instead of at the process-group timeout. None at W = 1."""
    if world == 1:
        yield None
        return
    with abort_scope() as scope:
        yield scope


def _peer_outcome(case: dict[str, Any], exc: PeerAborted) -> CaseOutcome:
    """This rank stopped waiting because a peer left the ring: oom when the peer's error was
    an allocation failure (the run is then an oom, the peer's case carries the bytes asked
    for), else failed; the process group is broken either way."""
    release(collect_cycles=True)
    return CaseOutcome(
        **case,
        status="oom" if exc.oom else "failed",
        error=f"stopped waiting: {exc}",
        group_broken=group_broken(),
    )


def _error_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


@dataclass
class _Loop:
    """What the timed loop measured: every timed iteration's seconds, the unix times of the
    first one's start and the last one's end, the ring steps of every timed iteration
    (attention.ring.steps; none for a kernel without a ring, or when not recorded), the
    meter's peak (0 without one), and in train mode each iteration's forward and backward."""

    times: list[float]
    first_at: float
    last_at: float
    steps: list[StepTime]
    peak: int
    forward: list[float] | None = None
    backward: list[float] | None = None


def _timed_loop(
    module: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    config: RunConfig,
    meter: PeakMeter | None,
    device: torch.device,
    record_steps: bool = True,
    trace: contextlib.AbstractContextManager[None] | None = None,
) -> _Loop:
    """Warm-up, then every timed iteration (barrier before each; config.iterations of them,
    under auto as many as workers.noise.Iterations decides, the same on every rank); returns
    what they measured (_Loop): in train mode each iteration's forward and backward timed
    apart besides the whole.

    The peak meter is reset once the inputs exist, read after the case's first iteration (the
    first warm-up one, else the first timed one: every iteration computes the same) and then
    stopped. On CPU it meters through a torch.profiler session (workers.memory.PeakMeter),
    whose overhead therefore lands on the first iteration only: a timing with warmup 0
    includes it in its first time. `trace` (the run's own profiler, `profile: true`) starts
    once the meter has stopped, since torch runs one profiler session at a time.

    At W > 1 the loop runs in a ring abort scope (attention.ring.comm.abort_scope): a rank
    that raises in it (out of memory above all) flags it, and its peers leave their waits
    with PeerAborted within ABORT_POLL_S instead of at the process-group timeout.
    """
    train = config.mode == "train"
    world = config.world_size
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    if train:
        for t in (q, k, v):
            t.requires_grad_(True)

    marks = _PhaseMarks(device)

    def step() -> None:
        if train:
            marks.mark()
            out = module(q, k, v, causal=config.causal)
            marks.mark()
            out.backward(inputs["dout"])
            marks.mark()
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                out = module(q, k, v, causal=config.causal)
        del out

    before = compiled.stats()
    with _ring_scope(world):
        loop = _scoped_loop(step, config, meter, device, record_steps, trace)
    made = compiled.stats().since(before).compilations
    if made and meter is not None:  # the measured loop (the prime's runs unmetered)
        raise RuntimeError(
            f"{made} torch.compile compilation(s) ran inside the metered iterations at "
            f"seq_len {config.seq_len} ({config.mode}): the warm-up did not absorb them, so "
            "the times and the peak would include compiling"
        )
    if train:
        loop.forward, loop.backward = marks.phases(len(loop.times))
    return loop


class _PhaseMarks:
    """Marks between the phases of each train iteration (before the forward, between forward
    and backward, after the backward): CUDA events on GPU, perf_counter on CPU, read once the
    loop is over (every timed iteration is synchronized by then)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases(self, iterations: int) -> tuple[list[float], list[float]]:
        """(forward, backward) seconds of the last `iterations` iterations (the timed ones)."""
        spans = [
            self._seconds(self.marks[i], self.marks[i + 1]) for i in range(len(self.marks) - 1)
        ]
        fwd = [spans[i] for i in range(0, len(spans), 3)]
        bwd = [spans[i] for i in range(1, len(spans), 3)]
        return fwd[len(fwd) - iterations :], bwd[len(bwd) - iterations :]

    def _seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end) / 1e3 if self.cuda else end - start)


def _scoped_loop(
    step: Callable[[], None],
    config: RunConfig,
    meter: PeakMeter | None,
    device: torch.device,
    record_steps: bool,
    trace: contextlib.AbstractContextManager[None] | None,
) -> _Loop:
    """_timed_loop's iterations, inside its ring abort scope."""
    world = config.world_size
    timed = timer(device)
    peak = 0
    _barrier(world)
    if meter is not None:
        meter.reset()
    with contextlib.ExitStack() as after_first:

        def first_done() -> None:
            """The case's first iteration is over: read the peak, stop the meter, trace."""
            nonlocal peak
            if meter is not None:
                peak = meter.peak()
                meter.stop()
            if trace is not None:
                after_first.enter_context(trace)

        for i in range(config.warmup):
            _barrier(world)
            step()
            if i == 0:
                first_done()
        sync(device)
        times: list[float] = []
        steps: list[StepTime] = []
        first_at = time.time()
        if record_steps:
            clock.start(device)
        count = Iterations(config.iterations, config.time_cap_s, world, device)
        count.start()
        try:
            while count.more(times):  # under auto a collective: every rank runs the same count
                i = len(times)
                _barrier(world)
                times.append(timed(step))  # synchronized: CUDA events done
                steps += [StepTime(iteration=i, **row) for row in clock.collect()]
                if i == 0 and config.warmup == 0:
                    first_done()
        finally:
            clock.stop()
    return _Loop(times, first_at, time.time(), steps, peak)


_PRIMED: set[str] = set()
_COMPILING: set[str] = set()
"""Prime keys whose short warm-up compiled something (a plugin's own torch.compile): such a
case primes at its own length too, as a kernel of attention.compiled does."""


def _compiles(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether the kernel (or a kernel inside it: multihead's) runs a compiled kernel of
    attention.compiled on `device` (its `compiles(device)`)."""
    asks = (getattr(m, "compiles", None) for m in module.modules())
    return any(callable(ask) and bool(ask(device)) for ask in asks)


def _prime(config: RunConfig, rank: int, device: torch.device) -> None:
    """Warm the process up before the case's metered iterations, outside every timing.

    A compiled plan (attention.compiled: block_sparse's cuda plan, the flex adapters; or a
    kernel whose short warm-up compiled) runs once at the run's own length and mode, every
    run, whatever config.warmup: torch.compile makes one graph per shape and grad mode, so this
    call is where the run's compilation happens, and no timed iteration and no peak holds
    one. Other kernels run once at a small length (PRIME_MIN_LEN), once per process and case
    shape, so that lazy one-time allocations (thread pools, library workspaces) are not
    counted in a case's peak."""
    key = config.model_dump_json(include={"kernel", "params", "dtype", "mode", "causal"})
    key += f"{device}|{config.world_size}|{config.parallel}"
    compiling = key in _COMPILING or _compiles(kernels.build(config, device), device)
    if not compiling and key not in _PRIMED:
        small = config.model_copy(update={"seq_len": shorter_length(config, PRIME_MIN_LEN)})
        before = compiled.stats()
        _run_once(small, rank, device)
        _PRIMED.add(key)
        if compiled.stats().since(before).compilations:
            _COMPILING.add(key)
            compiling = True
    if compiling:
        _run_once(config, rank, device)


def _run_once(config: RunConfig, rank: int, device: torch.device) -> None:
    """One untimed, unmetered iteration of the case `config` on fresh inputs."""
    sworld = kernels.shard_world(config)
    module = kernels.build(config, device)
    positions = kernels.local_positions(
        module, config, config.seq_len, rank if sworld > 1 else 0, sworld
    )
    names = ["q", "k", "v", "dout"] if config.mode == "train" else ["q", "k", "v"]
    rows = batch_rows(config, rank)
    inputs = {n: make_input(n, config, config.seq_len, positions, rows, device) for n in names}
    quiet = config.model_copy(update={"warmup": 0, "iterations": 1, "time_cap_s": None})
    _timed_loop(module, inputs, quiet, None, device, record_steps=False)
    sync(device)
    del inputs, module
    release()


def _oom_outcome(case: dict[str, Any], message: str) -> CaseOutcome:
    """A caught allocation failure (timed loop, priming, correctness check): an oom case, its
    memory given back first so the rank stays usable."""
    release(collect_cycles=True)
    return CaseOutcome(
        **case,
        status="oom",
        error=message,
        requested_bytes=requested_bytes(message),
        group_broken=group_broken(),
    )


def run_case(config: RunConfig, rank: int = 0, kind: str = "benchmark") -> CaseOutcome:
    """Run one case as `rank` of config.world_size and return what it measured.

    Status ok, oom (a caught allocation failure, or on CPU a peak over the memory budget,
    flagged emulated) or failed (the correctness gate, or an error). With world_size > 1 the
    process group must be initialized (the gang does it). A failed case keeps the environment
    and, when the error came after the gate, the gate's result in its error.
    """
    world = config.world_size
    if world > 1 and not dist.is_initialized():
        raise RuntimeError(f"world_size={world} needs an initialized process group")
    kernels.check_mode(config)
    device = resolve_device(config)
    if device.type == "cuda":  # device auto resolved to CUDA: the fused ops' head_dim limits
        attention.check_cuda_head_dim(
            config.kernel, DTYPES[config.dtype], config.head_dim, kernels.kernel_params(config)
        )
    environment = collect(device, DTYPES[config.dtype])
    case = {"rank": rank, "seq_len": config.seq_len, "environment": environment}
    gate: GateResult | None = None
    before = compiled.stats()
    try:
        if kernels.gated(config, kind):
            checked = _gate(config, rank, device, kind, case)
            if isinstance(checked, CaseOutcome):
                return checked
            gate = checked
        if config.workload == "model":
            outcome = run_model_case(config, rank, case)
        else:
            outcome = _measure(config, rank, device, case)
    except Exception as exc:  # the case's error, kept with what it ran on
        after = f" (after the correctness gate passed: {gate.summary()})" if gate else ""
        return CaseOutcome(**case, status="failed", error=error_text(exc) + after)
    return _with_compile(_with_gate(outcome, gate), compiled.stats().since(before))


def _with_compile(outcome: CaseOutcome, made: compiled.Stats) -> CaseOutcome:
    """The outcome with what the run compiled on this rank (compile_s, compilations) on its
    result: Dynamo's totals over the gate, the warm-up and the loop, which compiles nothing
    (_timed_loop refuses a compilation there)."""
    if outcome.result is None:
        return outcome
    update = {"compile_s": made.compile_s, "compilations": made.compilations}
    return outcome.model_copy(update={"result": outcome.result.model_copy(update=update)})


def _gate(
    config: RunConfig, rank: int, device: torch.device, kind: str, case: dict[str, Any]
) -> GateResult | CaseOutcome:
    """The correctness gate (workers.gate), or the case it ends: failed beyond the tolerance,
    oom when the check itself ran out of memory. Not capped by the memory budget: the gate's
    float64 reference is not the measured workload."""
    try:
        with _ring_scope(config.world_size):  # its ring kernels and all_reduce, as the loop's
            gate = run_gate(config, rank, device, kind)
    except CheckOutOfMemory as exc:
        return _oom_outcome(case, str(exc))
    except PeerAborted as exc:
        return _peer_outcome(case, exc)
    if gate.passed(config.dtype):
        return gate
    return CaseOutcome(
        **case,
        status="failed",
        error=f"correctness check failed: max abs error {gate.summary()} exceeds "
        f"{gate.tolerance_text(config.dtype)} ({config.kernel} vs "
        f"{references.describe(config.kernel, config.params)}, {config.dtype}, {config.mode})",
    )


def _with_gate(outcome: CaseOutcome, gate: GateResult | None) -> CaseOutcome:
    """The outcome with the gate's figures on its result (a run without a gate: None)."""
    if outcome.result is None or gate is None:
        return outcome
    checked = {
        "max_abs_error": gate.full_error,
        "check_seq_len": gate.full_seq_len,
        "sampled_check_error": gate.sampled_error,
        "sampled_check_seq_len": gate.sampled_seq_len,
        "sampled_check_rows": gate.sampled_rows,
    }
    return outcome.model_copy(update={"result": outcome.result.model_copy(update=checked)})


def _over_budget(
    config: RunConfig, device: torch.device, case: dict[str, Any], tokens: int
) -> CaseOutcome | None:
    """CPU: an emulated oom when the inputs alone exceed the budget (so would the peak); they
    are then never allocated. None when they fit (or on CUDA, where the allocator decides)."""
    budget = config.memory_budget_bytes
    elem = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    heads = (2 if config.mode == "train" else 1) * config.num_heads  # q (and dout)
    input_bytes = tokens * heads * config.head_dim * elem + kv_block_bytes(config, tokens)
    if device.type != "cpu" or budget is None or input_bytes <= budget:
        return None
    return CaseOutcome(
        **case,
        status="oom",
        emulated=True,
        requested_bytes=input_bytes,
        error=f"inputs need {input_bytes} bytes, over the {budget}-byte CPU memory budget",
    )


def _prime_and_probe(
    config: RunConfig, rank: int, device: torch.device, case: dict[str, Any], tokens: int
) -> tuple[CaseOutcome | None, LinkFigures | None]:
    """The warm-up (_prime), then the ring link probe (before the inputs exist): (an oom or
    peer-abort outcome that ends the case, or None; the link figures)."""
    stage = "the warm-up run"
    try:
        with memory_fraction(device, config.memory_budget_bytes):
            _prime(config, rank, device)
            stage = "the link probe (one K/V block, before the inputs)"
            return None, measure_link(config, device, tokens)
    except PeerAborted as exc:
        return _peer_outcome(case, exc), None
    except Exception as exc:
        if not is_oom(exc):
            raise
        return _oom_outcome(case, f"{stage} ran out of memory: {_error_line(exc)}"), None


def _measure(
    config: RunConfig, rank: int, device: torch.device, case: dict[str, Any]
) -> CaseOutcome:
    """The attention workload: inputs, warm-up, the timed and metered iterations."""
    budget = config.memory_budget_bytes
    sworld = kernels.shard_world(config)
    srank = rank if sworld > 1 else 0
    module = kernels.build(config, device)
    positions = kernels.local_positions(module, config, config.seq_len, srank, sworld)
    rows = batch_rows(config, rank)
    train = config.mode == "train"
    tokens = config.local_batch * positions.numel()
    ended = _over_budget(config, device, case, tokens)
    if ended is not None:
        return ended
    ended, link = _prime_and_probe(config, rank, device, case, tokens)
    if ended is not None:
        return ended
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
                after_inputs = meter.current()
                trace = profiled(config.profile, device, rank, artifacts)
                loop = _timed_loop(module, inputs, config, meter, device, trace=trace)
                device_used = meter.device_used()  # CUDA, after the timed iterations
                backend, plan = kernels.backend_of(module), kernels.plan_of(module)
            except Exception as exc:
                if is_oom(exc):  # the failing rank's allocations, its inputs still held
                    artifacts += snapshot(device, rank)
                raise
    except PeerAborted as exc:
        inputs.clear()
        return _peer_outcome(case, exc).model_copy(update={"artifacts": artifacts})
    except Exception as exc:
        if not is_oom(exc):
            raise
        message = _error_line(exc)
        del exc
        inputs.clear()
        oom = _oom_outcome(case, message)
        return oom.model_copy(update={"artifacts": artifacts})
    finally:
        meter.stop()  # a failed case's profiler session ends here (CPU)
        inputs.clear()
        release()
    work = (*_work(module, config, positions.numel(), train), device_used)
    measures = _Measures(loop, after_inputs, meter.resident_peak(), backend, plan, *work)
    result = _rank_result(config, rank, tokens, measures, link)
    measured = measured_case(case, result, device, (loop.first_at, loop.last_at))
    return measured.model_copy(update={"artifacts": artifacts})


def _work(
    module: torch.nn.Module, config: RunConfig, local_len: int, train: bool
) -> tuple[float, float, int | None, tuple[int | None, int | None]]:
    """This rank's work per iteration on its `local_len` tokens: its FLOPs (in train mode
    forward and backward), the forward's FLOPs, its kept query-key pairs, and the K/V bytes it
    receives and wastes (kernels.comm_bytes)."""
    flops = kernels.flops(module, config, config.local_batch, local_len, train)
    forward = kernels.flops(module, config, config.local_batch, local_len, False)
    comm = kernels.comm_bytes(module, config, local_len, train)
    return flops, forward, kernels.kept_pairs(module, config, local_len), comm


@dataclass(frozen=True)
class _Measures:
    """What the timed and metered iterations of one case measured."""

    loop: _Loop
    after_inputs: int
    resident_peak: int | None
    backend: str
    plan: str | None
    flops: float
    forward_flops: float
    kept_pairs: int | None
    comm: tuple[int | None, int | None]
    device_used: int | None


def _rank_result(
    config: RunConfig, rank: int, tokens: int, m: _Measures, link: LinkFigures | None
) -> RankResult:
    """The rank's RankResult from its measures: the median and percentiles of its times (in
    train mode of its forward and backward times too)."""
    return RankResult(
        rank=rank,
        seq_len=config.seq_len,
        **timed_fields(m.loop.times, tokens, m.flops),
        peak_memory_bytes=m.loop.peak,
        input_memory_bytes=m.after_inputs,
        resident_peak_bytes=m.resident_peak,
        device_used_bytes=m.device_used,
        memory_budget_bytes=config.memory_budget_bytes,
        backend=m.backend,
        plan=m.plan,
        kept_pairs=m.kept_pairs,
        comm_bytes=m.comm[0],
        wasted_comm_bytes=m.comm[1],
        steps=m.loop.steps,
        **step_totals(m.loop.steps),
        **link_fields(link),
        **_phase_fields(m),
    )


def _phase_fields(m: _Measures) -> dict[str, Any]:
    """Train mode: the forward's and the backward's median, p10 and p90, their raw times and
    the forward's FLOPs (the kernel's own: flops(backward=False)); nothing in forward mode."""
    if m.loop.forward is None or m.loop.backward is None:
        return {}
    out: dict[str, Any] = {"forward_flops": m.forward_flops}
    for phase, times in (("forward", m.loop.forward), ("backward", m.loop.backward)):
        out[f"{phase}_times_s"] = times
        out[f"{phase}_s"] = statistics.median(times)
        out[f"{phase}_p10_s"] = percentile(times, 0.1)
        out[f"{phase}_p90_s"] = percentile(times, 0.9)
    return out
