"""The builders of the read model: a RunRow (service.results.rows) from a run, its rank results,
probes, environment and memory components, every derived number computed as the rows module's
docstring defines it (time, tokens/s, FLOP/s, memory, ring steps, link, crossover, model cells).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from service.db.models import (
    Environment,
    MemoryComponentRow,
    Probe,
    RankResultRow,
    Run,
    RunStatus,
)
from service.results.labels import scheme_text
from service.results.peaks import dense_peak_flops
from service.results.rows import Flag, RunRow, local_tokens, memory_floor
from service.results.stored import StoredComponent, StoredProbe, StoredRank
from service.results.work_share import (
    compute_imbalance,
    kept_pairs_imbalance,
    kept_tflops_per_s,
    local_batch,
    wasted_comm_share,
)
from workers import model_memory
from workers.config import RunConfig
from workers.noise import median_interval


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


class RunColumns(Protocol):
    """What run_row reads of a run: a Run, or its columns read without the ORM object (the
    context pass over a 100,000-run sweep, service.results.queries)."""

    @property
    def id(self) -> int: ...
    @property
    def sweep_id(self) -> int: ...
    @property
    def kernel(self) -> str: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def causal(self) -> bool: ...
    @property
    def mode(self) -> str: ...
    @property
    def status(self) -> RunStatus: ...
    @property
    def attempts(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def environment_id(self) -> int | None: ...
    @property
    def cotenants(self) -> list[Any] | None: ...
    @property
    def config(self) -> dict[str, Any]: ...


_Stored = TypeVar("_Stored", bound=BaseModel)
_FIELDS_SET: dict[frozenset[str], set[str]] = {}


def _stored(model: type[_Stored], value: Any) -> _Stored:
    """`model` validated from a stored row, its set of the fields it was given shared with
    every other read with the same fields: pydantic's own set (~2 KB for a rank's 42 columns)
    costs more than the values (a 100,000-run sweep's ranks: 200 MiB). Nothing reads which
    fields of a stored model were set (model_fields_set, exclude_unset), and nothing sets a
    field of one after it is read."""
    item = model.model_validate(value)
    given = item.__pydantic_fields_set__
    object.__setattr__(
        item, "__pydantic_fields_set__", _FIELDS_SET.setdefault(frozenset(given), given)
    )
    return item


def run_row(
    run: RunColumns,
    ranks: Sequence[RankResultRow],
    probes: Sequence[Probe],
    environment: Environment | None = None,
    components: Sequence[MemoryComponentRow] = (),
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
        ranks=[_stored(StoredRank, r) for r in sorted(ranks, key=lambda r: r.rank)],
        probes=[_stored(StoredProbe, p) for p in probes],
    )
    fits = [p.seq_len for p in row.probes if p.outcome == "fit"]
    row.max_seq_len = max(fits) if fits else None
    row.scheme = scheme_text(row)
    if row.ranks:
        _link(row, environment)
        _measured(row)
        row.matmul_fraction = matmul_fraction(row, environment)
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


def _model(row: RunRow, components: Sequence[MemoryComponentRow], tokens: int) -> None:
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
    by_rank: dict[int, list[StoredComponent]] = {}
    for c in components:
        view = _stored(StoredComponent, c)
        by_rank.setdefault(view.rank, []).append(view)
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
        row.optimizer_s = max(row.ranks, key=lambda r: r.median_s).optimizer_s
        predicted = [r.predicted_max_seq_len for r in row.ranks if r.predicted_max_seq_len]
        row.predicted_max_seq_len = min(predicted) if predicted else None
    if row.probes:
        row.predicted_peaks = predicted_peaks(row.config, [p.seq_len for p in row.probes])


def predicted_peaks(config: dict[str, Any], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(length, predicted step peak) of a model cell at each length (its searched probes):
    the same pure function the run stored its prediction from; empty when the cell's kernel
    has no memory model."""
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
        row.tflops_per_s = row.flops_per_s / 1e12
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
    row.plan = ",".join(sorted({r.plan for r in ranks if r.plan is not None})) or None
    errors = [r.max_abs_error for r in ranks if r.max_abs_error is not None]
    row.max_abs_error = max(errors) if errors else None
    checked = [r.check_seq_len for r in ranks if r.check_seq_len is not None]
    row.check_seq_len = min(checked) if checked else None
    sampled = [r.sampled_check_error for r in ranks if r.sampled_check_error is not None]
    row.sampled_check_error = max(sampled) if sampled else None
    first = ranks[0]  # every rank checks the same rows at the same length
    row.sampled_check_seq_len = first.sampled_check_seq_len
    row.sampled_check_rows = first.sampled_check_rows
    _phases(row, slow)
    _steps(row)
    _work_share(row)


def matmul_fraction(row: RunRow, environment: Environment | None) -> float | None:
    """The run's per-rank FLOP/s over the node's measured matmul rate (workers.matmul_probe):
    how much of what this device does for a plain product the attention reached."""
    rate = environment.matmul_flops_per_s if environment is not None else None
    if not rate or row.flops_per_s_per_rank is None:
        return None
    return row.flops_per_s_per_rank / rate


def _work_share(row: RunRow) -> None:
    """Each rank's share of the work (service.results.work_share): the kept pairs' and the
    measured compute's imbalance, and TFLOP/s from the kept pairs."""
    row.kept_pairs_imbalance = kept_pairs_imbalance(row.ranks)
    row.compute_imbalance = compute_imbalance(row.ranks)
    row.wasted_comm_share = wasted_comm_share(row.ranks)
    rows = local_batch(row.parallel, row.world_size, row.batch_size)
    forward, backward = kept_tflops_per_s(row.ranks, row.head_dim, rows, row.mode)
    row.kept_forward_tflops_per_s, row.kept_backward_tflops_per_s = forward, backward


def _phases(row: RunRow, slow: StoredRank) -> None:
    """Train mode: the slowest rank's forward and backward apart (medians, and for kernel
    cells their p10 and p90), and their TFLOP/s from the kernel's own forward FLOPs, summed
    over ranks as tflops_per_s sums the whole's."""
    row.forward_s, row.backward_s = slow.forward_s, slow.backward_s
    row.forward_p10_s, row.forward_p90_s = slow.forward_p10_s, slow.forward_p90_s
    row.backward_p10_s, row.backward_p90_s = slow.backward_p10_s, slow.backward_p90_s
    forward = [r.forward_flops for r in row.ranks if r.forward_flops is not None]
    if len(forward) != len(row.ranks) or not slow.forward_s or not slow.backward_s:
        return
    backward = sum(r.flops for r in row.ranks) - sum(forward)
    row.forward_tflops_per_s = sum(forward) / slow.forward_s / 1e12
    row.backward_tflops_per_s = backward / slow.backward_s / 1e12


def peak_flags(ranks: Sequence[StoredRank]) -> list[Flag]:
    """peak_below_inputs for a rank whose peak is below the inputs it held while that peak
    was metered: the peak counts those inputs, so the meter missed memory."""
    low = [r for r in ranks if r.peak_below_inputs]
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


def _crossover(row: RunRow, stepped: Sequence[StoredRank]) -> None:
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
    ranks: dict[int, list[RankResultRow]],
    probes: dict[int, list[Probe]],
    environments: dict[int, Environment],
    components: dict[int, list[MemoryComponentRow]] | None = None,
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
