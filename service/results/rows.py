"""The one read model of results: a typed row per run, built from the run, its rank results and
its probes. results.json, results.csv, report.md, the dashboard and the compare page all read
these rows, so every number has exactly one definition, here:

- measured length: the length the ranks measured (``RankResult.seq_len``): the cell's length for
  a benchmark, the search's answer for a max_seq_len run;
- time: the slowest rank's median per iteration (a ring step ends when its last rank does), with
  that rank's p10-p90 as the spread, and that rank's 95% confidence interval of the median
  (order statistics, workers.noise.median_interval; from 6 iterations on; with 2-5 the range of
  all its samples at the lower level median_ci_level says; none with 1) as the noise every
  ratio carries (service.results.baselines);
- iterations: the timed iterations the run ran (the length of its ranks' times_s);
- tokens/s: batch_size x measured length / time;
- FLOP/s: the FLOPs of every rank summed, over the time; per rank: that sum / world size;
- peak memory: each rank's own peak (reset for the case); the headline is the largest;
- memory floor (attention cells): q, k, v, out in the input dtype plus the fp32 lse, for the tokens
  one rank holds;
- memory per token: the largest rank peak over the tokens that rank holds;
- maximum length: the longest probe that fit;
- flags: a result above the physical limit (Flag), never shown without its mark: here a rank's
  peak below the inputs it held (peak_below_inputs); service.results.baselines adds the
  ratios' flags.

A ring run adds, from its ranks' steps (attention.ring.steps; table ring_step, and each rank's
totals in rank_result):
- exposed-communication share: the time every rank spent blocked on a transfer over its time in
  steps (compute + wait), summed over ranks and timed iterations;
- step coverage: the smallest share of a rank's iteration time its steps account for;
- crossover (`ring` only): the tokens per rank at which a step's compute would hide its
  transfer (F/B), from the rate the steps computed at (their FLOPs over their compute time)
  and the run's probed link.

Every sequence-parallel run over W > 1 ranks (any ring kernel, ours or a plugin's) measures its
ring links before its timed loop (workers.link: each rank pings one K/V block to its next
neighbour and back, alone, nothing else running); each rank stores its link's figures:
- link: the slowest rank's link bandwidth (a ring step ends when its slowest hop does), and the
  largest latency;
- link kind: what the link was: "loopback (one host)" for CPU ranks on one host (gloo over
  loopback TCP), "one host (GPU to GPU)" for GPU ranks on one host, "network (N hosts)" when
  the ranks spanned N hosts (the environment's hosts); it goes wherever the figure goes.
A step's transfer window (posting to completion, stored per step and each rank's best) is not a
link figure: it includes waiting for the peer to post its side.

A model cell (`workload: model`) adds, from its limiting rank (the largest measured step peak):
its memory components predicted and measured (ComponentView, ratio = measured / predicted);
fixed memory = parameters + gradients + optimizer states (measured); memory per token = (step
peak - fixed) / the tokens the rank holds; the predicted maximum length; the step's forward,
backward and optimizer times of the slowest rank; MFU = per-rank FLOP/s (6 x parameters per
token plus the kernel's attention FLOPs) over the device's dense peak (peak_fraction).

Raw units only (bytes, seconds, FLOP/s); formatting is the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from service.db.models import (
    Environment,
    MemoryComponent,
    Probe,
    ProbeOutcome,
    RankResult,
    Run,
    RunStatus,
)
from service.results.peaks import dense_peak_flops
from workers.noise import Interval, inverse, median_interval

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}

NOT_MEASURED_FIELDS = frozenset(
    {
        "name", "tags", "label", "timeout_s", "dist_timeout_s", "max_attempts", "iterations",
        "time_cap_s",
    }
)  # fmt: skip
"""Fields that name or bound a run without changing what it measures: two sweeps' cells match
(compare page) when their configs are equal once these are dropped. The iteration count and
time cap decide how many samples, not what is sampled (each run's interval says how sure its
median is): a cell rerun under `iterations: auto` matches its predecessor at 5."""


def config_key(config: dict[str, Any]) -> str:
    """The canonical JSON of a config without NOT_MEASURED_FIELDS: the compare page's cell key."""
    kept = {k: v for k, v in config.items() if k not in NOT_MEASURED_FIELDS}
    # a param set to None is the kernel's default, as if unset (see baselines._match_key)
    kept["params"] = {k: v for k, v in (kept.get("params") or {}).items() if v is not None}
    if not kept.get("profile"):  # unprofiled: what a cell stored before `profile` existed is
        kept.pop("profile", None)
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def local_tokens(parallel: str, world_size: int, batch_size: int, seq_len: int) -> int:
    """Tokens one rank holds: its share of the batch (data) or of the sequence (sequence)."""
    w = max(world_size, 1)
    if parallel == "data":
        return max(batch_size // w, 1) * seq_len
    return batch_size * max(seq_len // w, 1)


def memory_floor(
    dtype: str, num_heads: int, head_dim: int, tokens: int, num_kv_heads: int | None = None
) -> int | None:
    """Forward floor for `tokens` on one rank: q and out (2*h*d*bytes), k and v with their own
    heads (2*h_kv*d*bytes; h_kv = h without grouped-query attention) + fp32 lse (4*h)."""
    bpe = BYTES_PER_ELEMENT.get(dtype)
    if bpe is None:
        return None
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return (2 * (num_heads + kv) * head_dim * bpe + 4 * num_heads) * tokens


def device_name(env: Environment | None) -> str | None:
    """The device a run ran on: the first GPU's name, 'CPU' for a run without GPUs, else None."""
    if env is None:
        return None
    if env.gpus:
        first = env.gpus[0]
        if isinstance(first, dict):
            return str(first.get("name") or first.get("model") or "unknown GPU")
        return str(first)
    return "CPU"


@dataclass(frozen=True)
class ProbeView:
    """One tried length of a search, as measured (None where nothing was measured)."""

    seq_len: int
    outcome: str
    peak_memory_bytes: int | None
    input_memory_bytes: int | None
    rank_peak_bytes: list[int | None]
    requested_bytes: int | None
    time_s: float | None
    error: str | None
    emulated: bool


@dataclass(frozen=True)
class ComponentView:
    """One memory component of a model run's rank: predicted and measured bytes."""

    rank: int
    component: str
    predicted_bytes: int | None
    measured_bytes: int | None

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when either is missing or the prediction is 0)."""
        if self.measured_bytes is None or not self.predicted_bytes:
            return None
        return self.measured_bytes / self.predicted_bytes


FIXED_COMPONENTS = ("parameters", "gradients", "optimizer_states")
"""What a model holds whatever the length: the seed's 'fixed' memory."""


def model_text(model: dict[str, Any] | None) -> str | None:
    """A model's name, else its shape (None for an attention-only cell)."""
    if not model:
        return None
    return str(model["name"]) if model.get("name") else model_shape(model)


def model_shape(model: dict[str, Any]) -> str:
    """d_model x heads x layers, as the seed writes it (768d×12h×12L)."""
    return f"{model.get('d_model')}d×{model.get('n_heads')}h×{model.get('n_layers')}L"


@dataclass(frozen=True)
class RankView:
    """What one rank measured, as stored."""

    rank: int
    seq_len: int
    times_s: list[float]
    median_s: float
    p10_s: float
    p90_s: float
    flops: float
    peak_memory_bytes: int
    input_memory_bytes: int | None
    memory_budget_bytes: int | None
    backend: str
    max_abs_error: float | None
    check_seq_len: int | None
    sampled_check_error: float | None = None
    sampled_check_seq_len: int | None = None
    sampled_check_rows: int | None = None
    resident_peak_bytes: int | None = None
    """CPU: the process' RSS high-water mark above the baseline (not the allocator's peak)."""
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    predicted_max_seq_len: int | None = None
    step_compute_s: float | None = None
    step_wait_s: float | None = None
    step_received_bytes: int | None = None
    transfer_window_bytes_per_s: float | None = None
    link_probe_bytes: int | None = None
    link_probe_bytes_per_s: float | None = None
    link_latency_s: float | None = None
    node: str | None = None
    """The node it ran on (its Ray node's IP; None before migration 0015)."""


@dataclass(frozen=True)
class Flag:
    """A number above its physical limit: `code` (short, stable), the row `field` it marks,
    and a sentence that says what is wrong with it."""

    code: str
    field: str
    text: str


@dataclass
class RunRow:
    """One run with every number a table or chart shows for it (see the module docstring)."""

    run_id: int
    sweep_id: int
    kernel: str
    params: dict[str, Any]
    config: dict[str, Any]
    seq_len: int = field(metadata={"doc": "The cell's length (a search's start)."})
    world_size: int
    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    mode: str
    parallel: str
    searched: bool
    status: str
    attempts: int
    error: str | None
    environment_id: int | None
    device: str | None
    ranks: list[RankView]
    probes: list[ProbeView]
    measured_seq_len: int | None = None
    median_s: float | None = None
    p10_s: float | None = None
    p90_s: float | None = None
    median_lo_s: float | None = None
    median_hi_s: float | None = None
    median_ci_level: float | None = None
    iterations: int | None = None
    tokens_per_s: float | None = None
    flops_per_s: float | None = None
    flops_per_s_per_rank: float | None = None
    peak_fraction: float | None = None
    peak_memory_bytes: int | None = None
    rank_peak_bytes: list[int] = field(default_factory=list)
    input_memory_bytes: int | None = None
    resident_peak_bytes: int | None = None
    floor_bytes: int | None = None
    memory_per_token_bytes: float | None = None
    max_seq_len: int | None = None
    backend: str | None = None
    max_abs_error: float | None = None
    check_seq_len: int | None = None
    sampled_check_error: float | None = None
    sampled_check_seq_len: int | None = None
    sampled_check_rows: int | None = None
    # Ring kernels: where the time goes (see the module docstring).
    exposed_comm_share: float | None = None
    step_coverage: float | None = None
    ulysses_groups: str | None = field(
        default=None,
        metadata={"doc": "usp: each Ulysses group's ranks and the node(s) they ran on."},
    )
    comm_bytes_per_rank: float | None = field(
        default=None,
        metadata={"doc": "Bytes moved per rank per timed iteration: the most any rank received."},
    )
    step_flops_per_s_per_rank: float | None = field(
        default=None,
        metadata={"doc": "One rank's compute rate in its steps: FLOPs / step compute seconds."},
    )
    # W > 1 sequence parallel: the probed ring link (see the module docstring).
    link_probe_bytes_per_s: float | None = None
    link_latency_s: float | None = None
    link_kind: str | None = None
    crossover_tokens: float | None = None
    crossover_basis: str | None = None
    outcome: str = ""
    label: str = ""
    series: str = ""
    # Filled by service.results.baselines.apply: the baseline and the ratios against it.
    baseline_run_id: int | None = None
    baseline: str | None = None
    speedup: float | None = None
    memory_ratio: float | None = None
    max_len_gain: float | None = None
    efficiency: float | None = None
    speedup_lo: float | None = None
    speedup_hi: float | None = None
    efficiency_lo: float | None = None
    efficiency_hi: float | None = None
    within_noise: list[str] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    cotenants: list[int] | None = field(
        default=None,
        metadata={
            "doc": "Runs whose gangs shared this run's nodes while it ran (None: never "
            "placed, or stored before they were recorded): its times may include contention."
        },
    )
    # Model cells (workload: model); None / empty for attention-only cells.
    workload: str = "attention"
    model: str | None = None
    model_shape: str | None = None
    optimizer: str | None = None
    precision: str | None = None
    checkpointing: str | None = None
    components: list[ComponentView] = field(default_factory=list)
    fixed_bytes: int | None = None
    predicted_fixed_bytes: int | None = None
    bytes_per_token: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_max_seq_len: int | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    checkpoint_time_ratio: float | None = None  # filled by analysis: time / no checkpointing
    checkpoint_time_ratio_lo: float | None = None
    checkpoint_time_ratio_hi: float | None = None
    predicted_peaks: list[tuple[int, int]] = field(default_factory=list)

    def component(self, name: str) -> ComponentView | None:
        """The limiting rank's component `name`, if stored."""
        return next((c for c in self.components if c.component == name), None)

    @property
    def time_interval(self) -> Interval | None:
        """The median time's interval (None without one: 1 iteration, or nothing measured)."""
        if self.median_lo_s is None or self.median_hi_s is None or self.median_ci_level is None:
            return None
        return Interval(self.median_lo_s, self.median_hi_s, self.median_ci_level)

    @property
    def tokens_per_s_interval(self) -> Interval | None:
        """tokens/s from the time's interval: batch x measured length / [hi, lo]."""
        if self.measured_seq_len is None:
            return None
        return inverse(self.time_interval, self.batch_size * self.measured_seq_len)

    def flag(self, code: str, field: str) -> Flag | None:
        """This row's flag `code` on `field`, if raised."""
        return next((f for f in self.flags if f.code == code and f.field == field), None)

    def flags_on(self, field: str) -> list[Flag]:
        """The flags that mark `field` (a number never shown without them)."""
        return [f for f in self.flags if f.field == field]

    @property
    def tflops_per_s(self) -> float | None:
        return None if self.flops_per_s is None else self.flops_per_s / 1e12

    @property
    def length(self) -> int:
        """Where the run sits on a length axis: the measured length, else the cell's."""
        return self.measured_seq_len or self.seq_len

    @property
    def cell_key(self) -> str:
        return config_key(self.config)

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values (the dashboard's payload row)."""
        out = asdict(self)
        out.pop("config")
        out["tflops_per_s"] = self.tflops_per_s
        for c, view in zip(out["components"], self.components, strict=True):
            c["ratio"] = view.ratio
        out["length"] = self.length
        return out


def _outcome(status: str, row: RunRow) -> str:
    """A short outcome: ok with the gate's errors and both lengths they were checked at
    (every row at the full check's, sampled rows at the run's), or ok (not checked)."""
    if status == "succeeded":
        if row.max_abs_error is None:
            return "ok (not checked)"
        at = f" at {row.check_seq_len:,}" if row.check_seq_len is not None else ""
        text = f"ok (max abs err {row.max_abs_error:.1e}{at}"
        if row.sampled_check_error is not None and row.sampled_check_seq_len is not None:
            text += f"; {row.sampled_check_error:.1e} at {row.sampled_check_seq_len:,}"
            text += f" on {row.sampled_check_rows} rows"
        return text + ")"
    return {"oom": "OOM", "timed_out": "timed out"}.get(status, status)


def run_row(
    run: Run,
    ranks: Sequence[RankResult],
    probes: Sequence[Probe],
    environment: Environment | None = None,
    components: Sequence[MemoryComponent] = (),
) -> RunRow:
    """The row of one run: its cell and every derived number (None where nothing was measured)."""
    cfg = run.config or {}
    status = str(RunStatus(run.status).value)
    row = RunRow(
        run_id=run.id,
        sweep_id=run.sweep_id,
        kernel=run.kernel,
        params=dict(cfg.get("params") or {}),
        config=cfg,
        seq_len=run.seq_len,
        world_size=run.world_size,
        batch_size=int(cfg.get("batch_size", 1)),
        num_heads=int(cfg.get("num_heads", 8)),
        num_kv_heads=int(cfg.get("num_kv_heads") or cfg.get("num_heads", 8)),
        head_dim=int(cfg.get("head_dim", 64)),
        dtype=run.dtype,
        causal=run.causal,
        mode=run.mode,
        parallel=str(cfg.get("parallel", "sequence")),
        searched=cfg.get("search") is not None,
        status=status,
        attempts=run.attempts,
        error=run.error,
        environment_id=run.environment_id,
        cotenants=None if run.cotenants is None else list(run.cotenants),
        device=device_name(environment),
        ranks=[
            RankView(
                rank=r.rank,
                seq_len=r.seq_len,
                times_s=list(r.times_s),
                median_s=r.median_s,
                p10_s=r.p10_s,
                p90_s=r.p90_s,
                flops=r.flops,
                peak_memory_bytes=r.peak_memory_bytes,
                input_memory_bytes=r.input_memory_bytes,
                resident_peak_bytes=r.resident_peak_bytes,
                memory_budget_bytes=r.memory_budget_bytes,
                backend=r.backend,
                max_abs_error=r.max_abs_error,
                check_seq_len=r.check_seq_len,
                sampled_check_error=r.sampled_check_error,
                sampled_check_seq_len=r.sampled_check_seq_len,
                sampled_check_rows=r.sampled_check_rows,
                forward_s=r.forward_s,
                backward_s=r.backward_s,
                optimizer_s=r.optimizer_s,
                predicted_max_seq_len=r.predicted_max_seq_len,
                step_compute_s=r.step_compute_s,
                step_wait_s=r.step_wait_s,
                step_received_bytes=r.step_received_bytes,
                transfer_window_bytes_per_s=r.transfer_window_bytes_per_s,
                link_probe_bytes=r.link_probe_bytes,
                link_probe_bytes_per_s=r.link_probe_bytes_per_s,
                link_latency_s=r.link_latency_s,
                node=r.node,
            )
            for r in sorted(ranks, key=lambda r: r.rank)
        ],
        probes=[
            ProbeView(
                seq_len=p.seq_len,
                outcome=str(ProbeOutcome(p.outcome).value),
                peak_memory_bytes=p.peak_memory_bytes,
                input_memory_bytes=p.input_memory_bytes,
                rank_peak_bytes=list(p.rank_peak_bytes or []),
                requested_bytes=p.requested_bytes,
                time_s=p.time_s,
                error=p.error,
                emulated=p.emulated,
            )
            for p in probes
        ],
    )
    fits = [p.seq_len for p in row.probes if p.outcome == "fit"]
    row.max_seq_len = max(fits) if fits else None
    if row.ranks:
        _link(row, environment)
        _measured(row)
        row.ulysses_groups = ulysses_groups(row)
    tokens = local_tokens(row.parallel, row.world_size, row.batch_size, row.length)
    if cfg.get("workload") != "model":  # the kernel's floor is no floor of a training step
        row.floor_bytes = memory_floor(
            row.dtype, row.num_heads, row.head_dim, tokens, row.num_kv_heads
        )
    if row.peak_memory_bytes is not None:
        row.memory_per_token_bytes = row.peak_memory_bytes / tokens
    row.outcome = _outcome(status, row)
    if cfg.get("workload") == "model":
        _model(row, components, tokens)
    return row


def _model(row: RunRow, components: Sequence[MemoryComponent], tokens: int) -> None:
    """Fill a model cell's fields: its training setup, and the limiting rank's components."""
    model = row.config.get("model") or {}
    training = row.config.get("training") or {}
    row.workload = "model"
    row.model, row.model_shape = model_text(model), model_shape(model)
    row.optimizer = training.get("optimizer")
    row.precision = training.get("precision")
    checkpointing = training.get("checkpointing")
    if checkpointing == "every_k":
        checkpointing = f"every {training.get('checkpoint_every')}"
    row.checkpointing = checkpointing
    by_rank: dict[int, list[ComponentView]] = {}
    for c in components:
        view = ComponentView(c.rank, c.component, c.predicted_bytes, c.measured_bytes)
        by_rank.setdefault(c.rank, []).append(view)
    if by_rank:

        def peak_of(rank: int) -> int:
            step = next((c for c in by_rank[rank] if c.component == "step_peak"), None)
            return -1 if step is None or step.measured_bytes is None else step.measured_bytes

        limiting = max(sorted(by_rank), key=peak_of)
        row.components = by_rank[limiting]
        fixed = [row.component(n) for n in FIXED_COMPONENTS]
        if all(c is not None and c.measured_bytes is not None for c in fixed):
            row.fixed_bytes = sum(c.measured_bytes for c in fixed)  # type: ignore[union-attr,misc]
        if all(c is not None and c.predicted_bytes is not None for c in fixed):
            row.predicted_fixed_bytes = sum(c.predicted_bytes for c in fixed)  # type: ignore[union-attr,misc]
        step = row.component("step_peak")
        row.predicted_peak_bytes = None if step is None else step.predicted_bytes
        if row.peak_memory_bytes is not None and row.fixed_bytes is not None:
            row.bytes_per_token = (row.peak_memory_bytes - row.fixed_bytes) / tokens
    if row.ranks:
        slow = max(row.ranks, key=lambda r: r.median_s)
        row.forward_s, row.backward_s, row.optimizer_s = (
            slow.forward_s,
            slow.backward_s,
            slow.optimizer_s,
        )
        predicted = [r.predicted_max_seq_len for r in row.ranks if r.predicted_max_seq_len]
        row.predicted_max_seq_len = min(predicted) if predicted else None
    if row.probes:
        row.predicted_peaks = predicted_peaks(row.config, [p.seq_len for p in row.probes])


def predicted_peaks(config: dict[str, Any], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(length, predicted step peak) of a model cell at each length (its searched probes):
    the same pure function the run stored its prediction from; empty when the cell's kernel
    has no memory model."""
    from pydantic import ValidationError

    from workers import model_memory
    from workers.config import RunConfig

    try:
        cell = RunConfig.model_validate(config)
        return [(n, model_memory.predict(cell, n).step_peak) for n in sorted(set(lengths))]
    except (NotImplementedError, ValidationError):
        # no memory model, or a stored config today's rules refuse (bitsandbytes absent
        # here): the chart draws no predicted line; the stored predictions still show
        return []


def _measured(row: RunRow) -> None:
    """Fill the numbers derived from the ranks' measurement."""
    ranks = row.ranks
    lengths = {r.seq_len for r in ranks}
    if len(lengths) != 1:
        raise ValueError(f"run {row.run_id}: its ranks measured different lengths {lengths}")
    row.measured_seq_len = lengths.pop()
    slow = max(ranks, key=lambda r: r.median_s)
    row.median_s, row.p10_s, row.p90_s = slow.median_s, slow.p10_s, slow.p90_s
    row.iterations = len(slow.times_s)
    spread = median_interval(slow.times_s)
    if spread is not None:
        row.median_lo_s, row.median_hi_s, row.median_ci_level = spread.lo, spread.hi, spread.level
    if slow.median_s > 0:
        row.tokens_per_s = row.batch_size * row.measured_seq_len / slow.median_s
        row.flops_per_s = sum(r.flops for r in ranks) / slow.median_s
        row.flops_per_s_per_rank = row.flops_per_s / row.world_size
        peak = dense_peak_flops(row.device, row.dtype)
        row.peak_fraction = row.flops_per_s_per_rank / peak if peak else None
    row.rank_peak_bytes = [r.peak_memory_bytes for r in ranks]
    row.peak_memory_bytes = max(row.rank_peak_bytes)
    inputs = [r.input_memory_bytes for r in ranks if r.input_memory_bytes is not None]
    row.input_memory_bytes = max(inputs) if inputs else None
    row.flags += peak_flags(ranks)
    resident = [r.resident_peak_bytes for r in ranks if r.resident_peak_bytes is not None]
    row.resident_peak_bytes = max(resident) if resident else None
    row.backend = ",".join(sorted({r.backend for r in ranks}))
    errors = [r.max_abs_error for r in ranks if r.max_abs_error is not None]
    row.max_abs_error = max(errors) if errors else None
    checked = [r.check_seq_len for r in ranks if r.check_seq_len is not None]
    row.check_seq_len = min(checked) if checked else None
    sampled = [r.sampled_check_error for r in ranks if r.sampled_check_error is not None]
    row.sampled_check_error = max(sampled) if sampled else None
    first = ranks[0]  # every rank checks the same rows at the same length
    row.sampled_check_seq_len = first.sampled_check_seq_len
    row.sampled_check_rows = first.sampled_check_rows
    _steps(row)


def peak_flags(ranks: Sequence[RankView]) -> list[Flag]:
    """peak_below_inputs for a rank whose peak is below the inputs it held while that peak
    was metered: the peak counts those inputs, so the meter missed memory."""
    low = [
        r
        for r in ranks
        if r.input_memory_bytes is not None and r.peak_memory_bytes < r.input_memory_bytes
    ]
    if not low:
        return []
    which = "; ".join(
        f"rank {r.rank}: peak {r.peak_memory_bytes:,} B < inputs {r.input_memory_bytes:,} B"
        for r in low
    )
    text = f"peak below the inputs the rank held ({which}): the meter missed memory"
    return [Flag("peak_below_inputs", "peak_memory_bytes", text)]


def _steps(row: RunRow) -> None:
    """Fill where a ring run's time goes, from its ranks' step totals (see the docstring)."""
    stepped = [r for r in row.ranks if r.step_compute_s is not None and r.step_wait_s is not None]
    if not stepped:
        return
    compute = sum(r.step_compute_s or 0.0 for r in stepped)
    wait = sum(r.step_wait_s or 0.0 for r in stepped)
    if compute + wait > 0:
        row.exposed_comm_share = wait / (compute + wait)
    row.step_coverage = min(
        ((r.step_compute_s or 0.0) + (r.step_wait_s or 0.0)) / sum(r.times_s)
        for r in stepped
        if sum(r.times_s) > 0
    )
    iterations = len(stepped[0].times_s)
    if iterations:
        row.comm_bytes_per_rank = max(r.step_received_bytes or 0 for r in stepped) / iterations
        if compute > 0:
            row.step_flops_per_s_per_rank = sum(r.flops for r in stepped) * iterations / compute
    _crossover(row, stepped)


def link_kind(environment: Environment | None) -> str | None:
    """What a run's ring links were, from where its ranks ran (None: environment unknown):
    loopback for CPU ranks on one host, GPU to GPU on one host, network across hosts."""
    if environment is None or not environment.hosts:
        return None
    hosts = len(environment.hosts)
    if hosts > 1:
        return f"network ({hosts} hosts)"
    return "one host (GPU to GPU)" if environment.gpus else "loopback (one host)"


def ulysses_groups(row: RunRow) -> str | None:
    """usp: its Ulysses groups (ranks g U .. g U + U - 1, consecutive in the gang's order,
    which sorts ranks by node) and the nodes each ran on, e.g. 'ranks 0-1 on 10.0.0.1; ranks
    2-3 on 10.0.0.2'; a group across nodes says so (its all-to-all leaves the node). None for
    other kernels or ranks stored without their node."""
    if row.kernel != "usp" or not row.ranks or any(r.node is None for r in row.ranks):
        return None
    u = int(row.params.get("ulysses_degree", 2))
    nodes = {r.rank: r.node for r in row.ranks}
    parts = []
    for g in range(0, row.world_size, u):
        members = [r for r in range(g, g + u) if r in nodes]
        where = sorted({str(nodes[r]) for r in members})
        across = f" (across {len(where)} nodes)" if len(where) > 1 else ""
        parts.append(f"ranks {members[0]}-{members[-1]} on {', '.join(where)}{across}")
    return "; ".join(parts)


def _link(row: RunRow, environment: Environment | None) -> None:
    """The run's probed ring link: the slowest rank's bandwidth (a ring step lasts as long as
    its slowest hop), the largest latency, and what kind of link it was."""
    rates = [r.link_probe_bytes_per_s for r in row.ranks if r.link_probe_bytes_per_s is not None]
    if not rates:
        return
    row.link_probe_bytes_per_s = min(rates)
    latencies = [r.link_latency_s for r in row.ranks if r.link_latency_s is not None]
    row.link_latency_s = max(latencies) if latencies else None
    row.link_kind = link_kind(environment)


def _crossover(row: RunRow, stepped: Sequence[RankView]) -> None:
    """`ring` only: the tokens per rank at which a step's compute takes as long as its transfer
    (F/B), scaled from this run. A ring step's FLOPs grow with the square of the tokens per rank
    and its bytes linearly, so c* = c x (F / B) x (bytes / FLOPs) of one iteration, all ranks
    summed. F is one rank's rate in its steps (FLOPs per iteration x iterations / step
    compute seconds, averaged over ranks as sums over sums), B the run's probed link (its
    slowest). (Not for ring_dilated, whose FLOPs grow linearly, nor ring_block_sparse, whose
    mask decides.)"""
    if row.kernel != "ring" or not row.link_probe_bytes_per_s:
        return
    received = sum(r.step_received_bytes or 0 for r in stepped)
    flops = sum(r.flops for r in stepped)
    compute = sum(r.step_compute_s or 0.0 for r in stepped)
    iterations = len(stepped[0].times_s)
    if not (received and flops and compute and iterations):
        return
    flops_per_s = flops * iterations / compute
    tokens = local_tokens(row.parallel, row.world_size, row.batch_size, row.length)
    row.crossover_tokens = (
        tokens * flops_per_s * (received / iterations) / (row.link_probe_bytes_per_s * flops)
    )
    row.crossover_basis = f"step compute rate, probed link: {row.link_kind or 'kind unknown'}"


def rows_of(
    runs: Iterable[Run],
    ranks: dict[int, list[RankResult]],
    probes: dict[int, list[Probe]],
    environments: dict[int, Environment],
    components: dict[int, list[MemoryComponent]] | None = None,
) -> list[RunRow]:
    """Rows for runs whose results were read in bulk (service.results.queries)."""
    components = components or {}
    return [
        run_row(
            r,
            ranks.get(r.id, []),
            probes.get(r.id, []),
            environments.get(r.environment_id) if r.environment_id is not None else None,
            components.get(r.id, []),
        )
        for r in runs
    ]
