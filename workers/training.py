"""The `workload: model` protocol: train the decoder on one rank and measure memory by phase.

Step 1 is measured phase by phase, the peak reset between phases: parameters (after the
build), the forward (what stays: activations; above it: the forward transient), the backward
(what stays: gradients; its peak), the optimizer's first step (what stays: its states, checked
against the bytes in optimizer.state). Then `warmup` steps and `iterations` timed steps (a count, or
auto: workers.noise), each
split into forward / backward / optimizer. The step peak a budget is held to is the largest of
the phases' peaks and of the steps from step 2's optimizer step to the last warm-up step: the
meter (workers.memory.PeakMeter, on CPU c10's allocator through a profiler session) stops
before the timed steps, which repeat the warm-up ones, so they run without it.
Every component is stored beside its prediction (workers.model_memory).

A ring kernel trains sequence-parallel (each rank holds seq/W tokens at its kernel's global
positions, weights replicated); parallel=data splits the batch. Either way the gradients are
summed over the ranks after backward, the loss being divided by the global token count.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from workers import kernels, model_memory
from workers.config import RunConfig
from workers.harness import (
    link_fields,
    measure_link,
    measured_case,
    memory_fraction,
    resolve_device,
    sync,
    timed_fields,
)
from workers.inputs import shorter_length
from workers.link import LinkFigures
from workers.memory import PeakMeter, is_oom, release
from workers.model import Decoder, token_ids
from workers.noise import Iterations
from workers.results import CaseOutcome, MemoryComponent, RankResult
from workers.search import predicted_start

PRIME_MIN_LEN = 128
"""The one-block warm-up step runs at the smallest valid length >= this (or seq_len)."""
AUTOCAST_DTYPES = {"bf16_autocast": torch.bfloat16, "fp16_autocast": torch.float16}
FIRST_STEP_TRIES = 3
"""Steps tried for the optimizer's first real step (fp16's grad scaler skips overflows)."""
PREDICTION_GUARD = 2.0
"""On CPU, a case predicted to need more than this times its budget is not run (an emulated
OOM saying so): the budget emulates a smaller machine than this one, which must survive."""


def build_model(config: RunConfig, device: torch.device) -> Decoder:
    """The decoder on `device`, weights seeded by config.seed (fp32, or bf16 for pure bf16)."""
    assert config.model is not None and config.training is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        net = Decoder(config.model, config.training, lambda: kernels.build(config, device))
    dtype = torch.bfloat16 if config.training.precision == "bf16" else torch.float32
    return net.to(device=device, dtype=dtype)


def make_optimizer(config: RunConfig, net: Decoder, device: torch.device) -> torch.optim.Optimizer:
    """adamw: torch's fused AdamW; sgd: momentum 0.9; adamw8bit: bitsandbytes' AdamW8bit."""
    training = config.training
    assert training is not None
    params = list(net.parameters())
    if training.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=training.lr, fused=True)
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=training.lr, momentum=0.9)
    if device.type != "cuda":
        raise ValueError("training.optimizer: adamw8bit (bitsandbytes) runs on CUDA only")
    import bitsandbytes as bnb  # type: ignore[import-not-found]  # optional: ringlab[gpu]

    optimizer: torch.optim.Optimizer = bnb.optim.AdamW8bit(params, lr=training.lr)
    return optimizer


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer holds in its state."""
    return sum(
        t.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def rank_tokens(
    config: RunConfig, positions: torch.Tensor, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next tokens) of this rank's rows at these global positions, (local_batch, S)."""
    assert config.model is not None
    first_row = rank * config.local_batch if config.parallel == "data" else 0
    rows = torch.arange(first_row, first_row + config.local_batch)[:, None]
    at = rows * (config.seq_len + 1) + positions[None, :]
    vocab = config.model.vocab_size
    return (
        token_ids(at, vocab, config.seed).to(device),
        token_ids(at + 1, vocab, config.seed).to(device),
    )


class _Trainer:
    """One rank's model, optimizer, inputs and step phases."""

    def __init__(self, config: RunConfig, rank: int, device: torch.device) -> None:
        assert config.training is not None
        self.config, self.device = config, device
        self.training = config.training
        self.world = config.world_size
        self.net = build_model(config, device)
        self.kernel = self.net.kernel
        sworld = kernels.shard_world(config)
        srank = rank if sworld > 1 else 0
        self.positions = kernels.local_positions(
            self.kernel, config, config.seq_len, srank, sworld
        ).to(device)
        self.tokens, self.targets = rank_tokens(config, self.positions.cpu(), rank, device)
        self.n_tokens = config.batch_size * config.seq_len
        self.optimizer = make_optimizer(config, self.net, device)
        fp16 = self.training.precision == "fp16_autocast"
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = AUTOCAST_DTYPES.get(self.training.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def forward(self) -> torch.Tensor:
        with self._autocast():
            return self.net.loss(self.tokens, self.targets, self.positions, self.n_tokens)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.world > 1:
            for p in self.net.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)

    def step(self, zero: bool = True) -> None:
        """The optimizer step (through the grad scaler for fp16), then gradients dropped."""
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if zero:
            self.optimizer.zero_grad(set_to_none=True)


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


_PRIMED: set[str] = set()


def _prime(config: RunConfig, rank: int, device: torch.device) -> None:
    """One step of a one-block twin at a short length, once per process and training setup,
    so that one-time allocations (thread pools, autograd engine, library workspaces) are not
    counted in the first measured phase."""
    assert config.model is not None
    key = config.model_dump_json(include={"kernel", "params", "model", "training", "world_size"})
    key += f"{device}|{config.parallel}"
    if key in _PRIMED:
        return
    model = config.model.model_copy(update={"n_layers": 1})
    small = config.model_copy(update={"model": model})
    small = small.model_copy(update={"seq_len": shorter_length(small, PRIME_MIN_LEN)})
    trainer = _Trainer(small, rank, device)
    trainer.backward(trainer.forward())
    trainer.step()
    sync(device)
    del trainer
    release(collect_cycles=True)
    _PRIMED.add(key)


def _settled(meter: PeakMeter) -> int:
    """What the allocator holds now above the baseline (CUDA: its cache given back first)."""
    release()
    return meter.current()


def _predictions(config: RunConfig) -> tuple[dict[str, int | None], int | None, str | None]:
    """(component -> predicted bytes, predicted max length, why there is no prediction)."""
    try:
        predicted = model_memory.predict(config)
    except NotImplementedError as exc:
        return dict.fromkeys(model_memory.COMPONENTS), None, str(exc)
    longest = None
    if config.memory_budget_bytes is not None:
        longest = predicted_start(config)  # a length the kernel accepts, as the search's
    return predicted.components(), longest, None


def run_model_case(config: RunConfig, rank: int, case: dict[str, Any]) -> CaseOutcome:
    """Train `config.model` for 1 + warmup + iterations steps as `rank`; see the module doc.

    `case` holds the CaseOutcome fields the caller fills (rank, seq_len, environment).
    """
    device = resolve_device(config)
    budget = config.memory_budget_bytes
    predicted, predicted_max, no_prediction = _predictions(config)
    peak_guess = predicted["step_peak"]
    if (
        device.type == "cpu"
        and budget is not None
        and peak_guess is not None
        and peak_guess > PREDICTION_GUARD * budget
    ):
        return CaseOutcome(
            **case,
            status="oom",
            emulated=True,
            requested_bytes=peak_guess,
            error=f"not run: its predicted step peak {peak_guess} bytes is over "
            f"{PREDICTION_GUARD:g}x the {budget}-byte CPU memory budget",
        )
    meter = PeakMeter(device)
    try:
        with memory_fraction(device, budget):
            _prime(config, rank, device)
            tokens = config.local_batch * config.local_seq_len
            link = measure_link(config, device, tokens)  # a ring trains sequence-parallel
            return _measure(config, rank, device, case, predicted, predicted_max, meter, link)
    except Exception as exc:
        if not is_oom(exc):
            raise
        release(collect_cycles=True)
        text = str(exc).splitlines()[0] if str(exc) else ""
        note = f" ({no_prediction})" if no_prediction else ""
        return CaseOutcome(**case, status="oom", error=f"{type(exc).__name__}: {text}{note}")
    finally:
        meter.stop()  # CPU: a failed case's profiler session ends here


def _measure(
    config: RunConfig,
    rank: int,
    device: torch.device,
    case: dict[str, Any],
    predicted: dict[str, int | None],
    predicted_max: int | None,
    meter: PeakMeter,
    link: LinkFigures | None,
) -> CaseOutcome:
    """The model workload: memory per component over steps 1 and 2, then the timed steps."""
    meter.baseline()
    trainer = _Trainer(config, rank, device)
    measured: dict[str, int | None] = dict.fromkeys(model_memory.COMPONENTS)
    # The inputs are built with the model; their bytes are known exactly and taken off.
    inputs = sum(t.untyped_storage().nbytes() for t in (trainer.tokens, trainer.targets))
    inputs += trainer.positions.untyped_storage().nbytes()
    measured["parameters"] = _settled(meter) - inputs
    optimizer_tensors, peaks, resident = _first_step(trainer, meter, measured)
    peaks += _second_step(config, trainer, meter, measured, resident)
    meter.stop()  # CPU: the timed steps run without the meter's profiler session
    phases, (first_at, last_at) = _timed_steps(config, device, trainer)
    device_used = meter.device_used()  # CUDA, after the timed steps
    peak = max(peaks)
    measured["step_peak"] = peak
    if device.type == "cuda":
        measured["allocator_overhead"] = torch.cuda.max_memory_reserved(
            device
        ) - torch.cuda.max_memory_allocated(device)
    backend = kernels.backend_of(trainer.kernel)
    plan = kernels.plan_of(trainer.kernel)
    del trainer
    release()
    components = [
        MemoryComponent(
            component=name, predicted_bytes=predicted[name], measured_bytes=measured[name]
        )
        for name in model_memory.COMPONENTS
    ]
    components.append(
        MemoryComponent(
            component="optimizer_state_tensors",
            predicted_bytes=predicted["optimizer_states"],
            measured_bytes=optimizer_tensors,
        )
    )
    memory = {
        "peak_memory_bytes": peak,
        "input_memory_bytes": inputs,
        "device_used_bytes": device_used,
        "resident_peak_bytes": None
        if None in resident
        else max(r for r in resident if r is not None),
    }
    result = _model_result(config, rank, phases, memory, backend, predicted_max, components)
    result = result.model_copy(update={**link_fields(link), "plan": plan})
    return measured_case(case, result, device, (first_at, last_at))


def _first_step(
    trainer: _Trainer, meter: PeakMeter, measured: dict[str, int | None]
) -> tuple[int, list[int], list[int | None]]:
    """Step 1 creates the optimizer's states (and, on CPU, one-time buffers of this shape in
    the math libraries): measured is the jump across its optimizer step. (The optimizer's
    state bytes, [the step's peak], [its resident peak].)"""
    meter.reset()
    for _ in range(FIRST_STEP_TRIES):
        trainer.backward(trainer.forward())
        after_backward = _settled(meter)
        trainer.step(zero=False)
        measured["optimizer_states"] = _settled(meter) - after_backward
        optimizer_tensors = state_bytes(trainer.optimizer)
        trainer.optimizer.zero_grad(set_to_none=True)
        if optimizer_tensors:
            break  # else fp16's grad scaler skipped the step (an overflow): no state yet
    else:
        raise RuntimeError(
            f"the optimizer created no state in {FIRST_STEP_TRIES} steps (the fp16 grad "
            "scaler skipped every one: gradients overflow)"
        )
    return optimizer_tensors, [meter.peak()], [meter.resident_peak()]


def _second_step(
    config: RunConfig,
    trainer: _Trainer,
    meter: PeakMeter,
    measured: dict[str, int | None],
    resident: list[int | None],
) -> list[int]:
    """Step 2, phase by phase, in the steady state every later step repeats, then the rest of
    the warm-up: activations, forward transient, gradients and backward peak into `measured`,
    each phase's resident peak onto `resident`; the phases' peaks."""
    before = _settled(meter)
    meter.reset()
    loss = trainer.forward()
    after_forward = _settled(meter)
    forward_peak = meter.peak()
    resident.append(meter.resident_peak())
    measured["activations"] = after_forward - before
    measured["forward_transient"] = max(0, forward_peak - after_forward)
    meter.reset()
    trainer.backward(loss)
    del loss
    measured["gradients"] = _settled(meter) - before
    backward_peak = meter.peak()
    resident.append(meter.resident_peak())
    measured["backward_peak"] = backward_peak - before
    meter.reset()
    trainer.step()
    for _ in range(max(0, config.warmup - 1)):  # step 2 was one
        if config.world_size > 1:
            dist.barrier()
        trainer.backward(trainer.forward())
        trainer.step()
    steady_peak = meter.peak()  # step 2's optimizer step and the warm-up steps after it
    resident.append(meter.resident_peak())
    return [forward_peak, backward_peak, steady_peak]


def _timed_steps(
    config: RunConfig, device: torch.device, trainer: _Trainer
) -> tuple[dict[str, list[float]], tuple[float, float]]:
    """The timed steps, each phase timed apart: seconds per phase (forward, backward,
    optimizer) and the unix times of the first step's start and the last one's end."""
    world = config.world_size
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    first_at = time.time()
    count = Iterations(config.iterations, config.time_cap_s, world, device)
    count.start()
    steps: list[float] = []  # each timed step's forward + backward + optimizer seconds
    while count.more(steps):  # under auto a collective: every rank runs the same count
        if world > 1:
            dist.barrier()
        loss, t_fwd = _timed(device, trainer.forward)
        _, t_bwd = _timed(device, functools.partial(trainer.backward, loss))
        del loss
        _, t_opt = _timed(device, trainer.step)
        phases["forward"].append(t_fwd)
        phases["backward"].append(t_bwd)
        phases["optimizer"].append(t_opt)
        steps.append(t_fwd + t_bwd + t_opt)
    return phases, (first_at, time.time())


def _model_result(
    config: RunConfig,
    rank: int,
    phases: dict[str, list[float]],
    memory: dict[str, int | None],
    backend: str,
    predicted_max: int | None,
    components: list[MemoryComponent],
) -> RankResult:
    """The rank's RankResult: a step's time is its forward + backward + optimizer seconds."""
    times = [sum(p) for p in zip(*phases.values(), strict=True)]
    tokens = config.local_batch * config.local_seq_len
    return RankResult(
        rank=rank,
        seq_len=config.seq_len,
        **timed_fields(times, tokens, model_flops(config)),
        memory_budget_bytes=config.memory_budget_bytes,
        backend=backend,
        forward_s=statistics.median(phases["forward"]),
        backward_s=statistics.median(phases["backward"]),
        optimizer_s=statistics.median(phases["optimizer"]),
        predicted_max_seq_len=predicted_max,
        components=components,
        **memory,
    )


def model_flops(config: RunConfig) -> float:
    """FLOPs of one training step on this rank: 6 x parameters per token (forward and
    backward of every matmul weight: an untied embedding table is a lookup, not counted) plus
    the kernel's own attention FLOPs in every block (forward and backward); recomputation
    under checkpointing is not counted (model FLOPs)."""
    assert config.model is not None and config.training is not None
    model = config.model
    n_params, _, _ = model_memory.parameter_counts(model, config.training)
    if not model.tied_embeddings:
        n_params -= model.vocab_size * model.d_model
    tokens = config.local_batch * config.local_seq_len
    module = kernels.build(config, torch.device("cpu"))
    attention = kernels.flops(module, config, config.local_batch, config.local_seq_len, True)
    return 6.0 * n_params * tokens + config.model.n_layers * attention
