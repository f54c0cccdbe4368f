"""Typed results of the engine: what ranks measure, what a search probed, what a run ran on.

Raw units only (bytes, seconds, FLOPs). These models are the one declaration of what a rank
measures: service/db/models.py generates the columns of rank_result, probe, memory_component and
ring_step from their stored fields (every field not marked ENGINE_ONLY; a test holds the
environment table to EnvironmentInfo field for field), and the API returns them as they are.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RunStatus = Literal["succeeded", "failed", "oom"]
ProbeOutcome = Literal["fit", "oom", "error"]

ENGINE_ONLY: dict[str, Any] = {"stored": False}
"""json_schema_extra of a field the engine carries but no table stores as a column (its
rows go elsewhere, or it only steers the run's outcome): see stored_fields."""


def stored_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` its table stores, in declaration order: every field not marked
    ENGINE_ONLY. service.db.models generates the rank_result, probe, memory_component and
    ring_step columns from them, and the API returns them: each is declared here, once."""
    return tuple(
        name
        for name, info in model.model_fields.items()
        if not (
            isinstance(info.json_schema_extra, dict)
            and info.json_schema_extra.get("stored") is False
        )
    )


def stored(item: BaseModel) -> dict[str, Any]:
    """The stored fields of `item` (stored_fields) as a table's column values."""
    return item.model_dump(include=set(stored_fields(type(item))))


class MemoryComponent(BaseModel):
    """One memory component of a model run on one rank: predicted before, measured during."""

    model_config = ConfigDict(extra="forbid")

    component: str = Field(description="A name of workers.model_memory.COMPONENTS.")
    predicted_bytes: int | None = Field(None, description="None: no prediction for it.")
    measured_bytes: int | None = Field(None, description="None: not measurable here.")


class StepTime(BaseModel):
    """One step of a ring kernel on one rank in one timed iteration (attention.ring.steps):
    compute, time blocked on a transfer, and the bytes its transfers moved."""

    model_config = ConfigDict(extra="forbid")

    iteration: int = Field(ge=0, description="The timed iteration (0-based, warm-up excluded).")
    phase: Literal["forward", "backward"]
    step: int = Field(
        ge=0, description="ring, ring_block_sparse: the K/V of rank - step travelled."
    )
    compute_s: float = Field(ge=0, description="The step's time minus its waits.")
    wait_s: float = Field(ge=0, description="Time blocked waiting for a transfer.")
    sent_bytes: int = Field(0, ge=0, description="Bytes of the transfers the step posted.")
    received_bytes: int = Field(
        0, ge=0, description="Bytes of the transfers that completed in the step."
    )
    transfer_window_bytes_per_s: float | None = Field(
        None,
        description="The best bytes / window (posting to completion) of those transfers. The "
        "window includes waiting for the peer to post its side: not the link's bandwidth "
        "(RankResult.link_probe_bytes_per_s is).",
    )
    skipped: bool = Field(
        False,
        description="ring, usp's ring: the step computed nothing, the K/V it held keeping no "
        "pair with this rank's queries under the run's mask (they still travelled on). "
        "False for the other kernels' steps; null for steps stored before it was recorded.",
    )


def step_totals(steps: list[StepTime]) -> dict[str, Any]:
    """A rank's step totals over its timed iterations (None each when it has no steps):

    - step_compute_s, step_wait_s: summed over every step of every iteration;
    - step_received_bytes: bytes received, summed likewise;
    - transfer_window_bytes_per_s: the best of the steps' (a transfer's bytes over its window
      from posting to completion, which includes waiting for the peer to post: how fast the
      ring's transfers completed in the run, not the link's bandwidth; see workers.link).
    """
    if not steps:
        return {
            "step_compute_s": None,
            "step_wait_s": None,
            "step_received_bytes": None,
            "transfer_window_bytes_per_s": None,
        }
    rates = [
        s.transfer_window_bytes_per_s for s in steps if s.transfer_window_bytes_per_s is not None
    ]
    return {
        "step_compute_s": sum(s.compute_s for s in steps),
        "step_wait_s": sum(s.wait_s for s in steps),
        "step_received_bytes": sum(s.received_bytes for s in steps),
        "transfer_window_bytes_per_s": max(rates, default=None),
    }


class RankResult(BaseModel):
    """What one rank measured for one case: every timed iteration, throughput and peak memory."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(ge=0)
    seq_len: int = Field(
        ge=1, description="The total length this measurement ran at (a search's answer)."
    )
    times_s: list[float] = Field(description="Seconds of every timed iteration, in order.")
    median_s: float
    p10_s: float
    p90_s: float
    tokens_per_s: float = Field(description="Tokens this rank processed per second (median).")
    flops: float = Field(description="FLOPs this rank computed per iteration (kernel.flops).")
    flops_per_s: float
    peak_memory_bytes: int = Field(
        ge=0,
        description="Peak the device's allocator held above the pre-input baseline "
        "(max_memory_allocated's meaning; on CPU c10's CPU allocator, the ops' buffers included).",
    )
    input_memory_bytes: int | None = Field(
        None,
        ge=0,
        description="What the allocator held above the baseline once the inputs were allocated.",
    )
    resident_peak_bytes: int | None = Field(
        None,
        ge=0,
        description="CPU: the process' resident-set (RSS) high-water mark above the baseline's "
        "resident set over the metered iteration, not the allocator's figure: it misses heap "
        "pages earlier work left resident and counts glibc's fragmentation. None on CUDA.",
    )
    device_used_bytes: int | None = Field(
        None,
        ge=0,
        description="CUDA: the device's used bytes (cudaMemGetInfo, device-wide) after the "
        "timed iterations minus at the pre-input baseline: what peak_memory_bytes leaves out "
        "(NCCL's buffers, cuBLAS/cuDNN workspaces, the allocator's cached blocks) made in that "
        "span. None on CPU.",
    )
    memory_budget_bytes: int | None = None
    backend: str = Field(description="The kernel backend that ran (kernel.backend).")
    plan: str | None = Field(
        None,
        description="The execution plan this rank ran (kernel.plan: cpu or cuda) for the "
        "kernels that choose one by device (dilated, block_sparse, ring_dilated, ulysses over "
        "one of them): under `plan: auto` with device auto the stored config keeps auto, and "
        "this says what ran. None for the other kernels, and for ranks stored before.",
    )
    kept_pairs: int | None = Field(
        None,
        ge=0,
        description="Query-key pairs this rank's attention computes per iteration, summed over "
        "the heads, for one sequence (kernel.rank_pairs: only the tiles its plan keeps under the "
        "run's mask and balance); max over mean of the ranks is the work's imbalance. None for "
        "kernels that do not count their pairs per rank (single-process kernels, ulysses: each "
        "rank the whole sequence for its heads), and for ranks stored before.",
    )
    comm_bytes: int | None = Field(
        None,
        ge=0,
        description="K/V bytes this rank received per iteration for attention, its whole "
        "local batch (train mode: forward and backward each receive them): ring and allgather_kv "
        "gather all the other shards whole, gather needed only the K/V rows its queries keep a "
        "pair with; ulysses the other ranks' shards for its H_kv / W key/value heads (at least "
        "one); usp its Ulysses all-to-all's and its ring's K/V, for its H_kv / U heads; "
        "ring_block_sparse the shards of the steps its block plan computes with; ring_dilated "
        "each shared segment's dilated rows of a head group for that group's key/value heads, "
        "and the relayout to contiguous shards of zigzag or striped ones. Exact, from the mask, "
        "pattern and token order (attention.ring.needed); None for kernels that do not count "
        "it (single-process kernels) and for ranks stored before.",
    )
    wasted_comm_bytes: int | None = Field(
        None,
        ge=0,
        description="Of comm_bytes, those of K/V rows (one token's, all the key/value heads "
        "the message carries) none of this rank's queries keeps a pair with under the kernel's "
        "mask or pattern (ulysses, usp: the queries of its heads; ring_dilated: of the head "
        "group a segment's message serves); 0 under gather needed.",
    )
    max_abs_error: float | None = Field(
        None,
        description="The correctness gate's full check: max abs error of every row against "
        "the float64 reference (None: not checked).",
    )
    check_seq_len: int | None = Field(
        None,
        description="The length the full check ran at: twice the kernel's largest structural "
        "period, at most the run's (workers.gate.full_length).",
    )
    sampled_check_error: float | None = Field(
        None,
        description="The gate's sampled check at the run's own length: max abs error on "
        "sampled_check_rows query rows (None: the full check ran at the run's length).",
    )
    sampled_check_seq_len: int | None = Field(
        None, description="The length of the sampled check: the run's own."
    )
    sampled_check_rows: int | None = Field(
        None, description="Query rows the sampled check compared (edges, boundaries, random)."
    )
    emulated_oom: bool = Field(
        False,
        description="CPU: the peak exceeded memory_budget_bytes (an emulated OOM; the run's "
        "status says it, not a column).",
        json_schema_extra=ENGINE_ONLY,
    )
    forward_s: float | None = Field(
        None,
        description="Train mode (kernels and model runs): median seconds of the forward pass, "
        "timed apart within each timed iteration.",
    )
    backward_s: float | None = Field(
        None,
        description="Train mode: median seconds of the backward pass (model runs: the "
        "gradient all-reduce included).",
    )
    forward_p10_s: float | None = Field(
        None, description="Kernels in train mode: the forward times' 10th percentile."
    )
    forward_p90_s: float | None = Field(None, description="Their 90th percentile.")
    backward_p10_s: float | None = Field(
        None, description="Kernels in train mode: the backward times' 10th percentile."
    )
    backward_p90_s: float | None = Field(None, description="Their 90th percentile.")
    forward_times_s: list[float] | None = Field(
        None,
        description="Kernels in train mode: seconds of every timed iteration's forward pass, in "
        "order (times_s holds each whole iteration).",
    )
    backward_times_s: list[float] | None = Field(
        None, description="Kernels in train mode: every timed iteration's backward seconds."
    )
    forward_flops: float | None = Field(
        None,
        description="Kernels in train mode: the forward pass's FLOPs of this rank per iteration "
        "(kernel.flops(backward=False)); flops - forward_flops is the backward's.",
    )
    optimizer_s: float | None = Field(None, description="Model runs: median optimizer step.")
    predicted_max_seq_len: int | None = Field(
        None, description="Model runs with a memory budget: the longest length predicted to fit."
    )
    components: list[MemoryComponent] = Field(
        default_factory=list,
        description="Model runs: memory per component (rows of memory_component).",
        json_schema_extra=ENGINE_ONLY,
    )
    steps: list[StepTime] = Field(
        default_factory=list,
        description="Sequence-parallel kernels (ring steps, ulysses' all-to-alls and inner kernel, "
        "allgather_kv's gathers): every step of every timed iteration (rows of ring_step).",
        json_schema_extra=ENGINE_ONLY,
    )
    step_compute_s: float | None = Field(
        None, description="Sequence-parallel kernels: see step_totals."
    )
    step_wait_s: float | None = None
    step_received_bytes: int | None = None
    transfer_window_bytes_per_s: float | None = Field(
        None, description="Sequence-parallel kernels: the best of its steps' (see step_totals)."
    )
    compile_s: float | None = Field(
        None,
        ge=0,
        description="Seconds Dynamo spent compiling (torch.compile: traced frames and lazily "
        "compiled backward graphs, its own metric) while this rank ran the run: the gate's "
        "checks and the warm-up at the run's length, never a timed iteration (attention."
        "compiled.stats). 0.0 when nothing compiled; None: stored before it was recorded.",
    )
    compilations: int | None = Field(
        None, ge=0, description="Graphs Dynamo compiled for the run on this rank (same span)."
    )
    link_probe_bytes: int | None = Field(
        None,
        ge=1,
        description="Sequence parallel over W > 1: bytes of the K/V block (this rank's k and "
        "v shard, what one ring step sends) pinged to the next ring rank (rank + 1 mod W) and "
        "back before the timed loop (workers.link).",
    )
    link_probe_bytes_per_s: float | None = Field(
        None,
        gt=0,
        description="That link's bandwidth: link_probe_bytes / one-way time (the fastest "
        "timed round trip / 2), measured one link at a time, nothing else of the run going on.",
    )
    link_latency_s: float | None = Field(
        None,
        gt=0,
        description="That link's one-way time of a 4-byte message (fastest round trip / 2).",
    )


class ProbeResult(BaseModel):
    """One tried length of a max_seq_len search and how it ended (worst rank wins)."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(ge=1)
    outcome: ProbeOutcome
    peak_memory_bytes: int | None = Field(None, description="Max over ranks, when measured.")
    input_memory_bytes: int | None = Field(
        None, description="Largest memory over the ranks once the inputs were allocated."
    )
    rank_peak_bytes: list[int | None] = Field(
        default_factory=list, description="Each rank's peak in rank order (None: not measured)."
    )
    requested_bytes: int | None = Field(
        None, description="oom: the largest failed allocation over the ranks, when known."
    )
    time_s: float | None = Field(None, description="Median iteration time (slowest rank).")
    error: str | None = None
    emulated: bool = Field(False, description="oom decided by the CPU memory budget.")


class EnvironmentInfo(BaseModel):
    """What a run ran on: hosts, GPUs (name, memory) and the software stack, project git state."""

    model_config = ConfigDict(extra="forbid")

    hosts: list[str]
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    driver: str | None = None
    cuda: str | None = None
    torch: str
    nccl: str | None = None
    ray: str | None = None
    python: str
    git_sha: str | None = None
    git_dirty: bool | None = None
    plugins: dict[str, str] = Field(
        default_factory=dict, description="Kernel plugins installed: package -> version."
    )
    plugin_code: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The code version of each plugin package installed editable from a git "
        "checkout: package -> {git_sha, git_dirty (changes under its directory), path}.",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch's intra-op CPU threads in each rank: what a CPU kernel runs on (a "
        "CPU rank holds one Ray CPU, and Ray sets its OMP_NUM_THREADS to it), so CPU times "
        "compare only at equal counts.",
    )
    cpu_model: str | None = Field(
        None, description="The host CPU's model name (/proc/cpuinfo), to compare CPU times."
    )
    cpu_cores: int | None = Field(
        None, ge=1, description="Logical CPUs of the host (os.cpu_count()), not the rank's."
    )
    matmul_dtype: str | None = Field(
        None, description="The dtype of the node's matmul probe: the run's (workers.matmul_probe)."
    )
    matmul_size: int | None = Field(
        None, ge=1, description="Side n of the probe's square (n, n) @ (n, n) product."
    )
    matmul_s: float | None = Field(
        None, gt=0, description="The probe's best seconds for one product, on the rank's device."
    )
    matmul_flops_per_s: float | None = Field(
        None,
        gt=0,
        description="The node's measured matmul rate, 2 n^3 / matmul_s: what a kernel's FLOP/s "
        "is a fraction of (measured once per node, at the rank's CPU threads on CPU).",
    )

    def hash(self) -> str:
        """sha256 of the canonical JSON: the key environment rows are deduplicated by."""
        canon = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canon.encode()).hexdigest()

    @classmethod
    def merge(cls, parts: list[EnvironmentInfo]) -> EnvironmentInfo:
        """One environment for a gang: the hosts and GPUs of every rank, deduplicated, in order."""
        if not parts:
            raise ValueError("merge needs at least one environment")
        hosts = list(dict.fromkeys(h for p in parts for h in p.hosts))
        gpus: list[dict[str, Any]] = []
        for part in parts:
            gpus.extend(g for g in part.gpus if g not in gpus)
        return parts[0].model_copy(update={"hosts": hosts, "gpus": gpus})


class RankPlacement(BaseModel):
    """Where one rank ran: node, process, GPUs Ray assigned and the NCCL_* variables it saw."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    node_id: str
    node_ip: str
    hostname: str
    pid: int
    gpu_ids: list[str] = Field(default_factory=list)
    env_vars: dict[str, str] = Field(default_factory=dict)


class RunOutcome(BaseModel):
    """How a run ended, with every rank's result (and for max_seq_len every probe and the answer).

    status `oom`: a real OOM (ranks empty) or an emulated one on CPU (ranks hold what was
    measured, with emulated_oom set). status `failed`: `error` says which rank and why.
    """

    model_config = ConfigDict(extra="forbid")

    status: RunStatus
    ranks: list[RankResult] = Field(default_factory=list)
    probes: list[ProbeResult] = Field(default_factory=list)
    environment: EnvironmentInfo | None = None
    error: str | None = None
    answer_seq_len: int | None = Field(
        None, description="max_seq_len runs: the largest length that fit (None if none did)."
    )
    placement: list[RankPlacement] = Field(default_factory=list)
    gang_start_s: float | None = Field(
        None,
        description="Seconds spent starting the gang (placement, actors, process group); "
        "None when a warm gang was reused.",
    )
    first_iteration_at: float | None = Field(
        None, description="Unix time the first timed iteration began (earliest rank)."
    )
    last_iteration_at: float | None = Field(
        None, description="Unix time the last timed iteration ended (latest rank)."
    )
    artifacts: list[Artifact] = Field(
        default_factory=list, description="Every rank's artifacts (traces, memory snapshots)."
    )


class Artifact(BaseModel):
    """A file a rank produced (workers.artifacts): its bytes, or why they were not kept."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
    kind: Literal["chrome_trace", "memory_snapshot"]
    rank: int | None = None
    size_bytes: int = Field(ge=0)
    data: bytes | None = Field(None, description="The content; None when refused.")
    refused: str | None = Field(None, description="Why the bytes were not kept.")


CaseStatus = Literal["ok", "oom", "failed"]


class CaseOutcome(BaseModel):
    """What one rank returns for one case (one run, or one probe): its result or why there is none.

    `ok`: `result` holds the measurement. `oom`: a caught allocation failure (`result` None) or
    a CPU peak over the budget (`result` set, emulated). `failed`: `error` says why.
    """

    model_config = ConfigDict(extra="forbid")

    rank: int
    seq_len: int
    status: CaseStatus
    result: RankResult | None = None
    error: str | None = None
    emulated: bool = False
    peak_memory_bytes: int | None = None
    requested_bytes: int | None = Field(None, description="The failed allocation, if known.")
    group_broken: bool = Field(
        False,
        description="This rank left its ring mid-step (an abort: its own error or a peer's): "
        "its process group holds unfinished transfers, so the gang runs no further case on it.",
    )
    environment: EnvironmentInfo | None = None
    first_iteration_at: float | None = None
    last_iteration_at: float | None = None
    artifacts: list[Artifact] = Field(default_factory=list)


def outcome_of(cases: list[CaseOutcome], world_size: int) -> RunOutcome:
    """A run's outcome from its ranks' cases: failed beats oom beats succeeded; every rank's
    artifacts are kept whatever the status (an OOM's memory snapshot above all)."""
    environment = _environment(cases)
    common: dict[str, Any] = {
        "artifacts": [a for c in cases for a in c.artifacts],
        "first_iteration_at": min(
            (c.first_iteration_at for c in cases if c.first_iteration_at is not None),
            default=None,
        ),
        "last_iteration_at": max(
            (c.last_iteration_at for c in cases if c.last_iteration_at is not None), default=None
        ),
    }
    failed = [c for c in cases if c.status == "failed"]
    if failed:
        # The root cause first: an abandoned rank only reports another's failure.
        failed.sort(key=lambda c: (c.error or "").startswith("abandoned"))
        error = "; ".join(f"rank {c.rank}: {c.error}" for c in failed)
        return RunOutcome(status="failed", error=error, environment=environment, **common)
    ooms = [c for c in cases if c.status == "oom"]
    ranks = [c.result for c in cases if c.result is not None]
    if ooms:
        error = "; ".join(f"rank {c.rank}: {c.error}" for c in ooms)
        kept = ranks if len(ranks) == world_size else []
        return RunOutcome(status="oom", error=error, ranks=kept, environment=environment, **common)
    return RunOutcome(status="succeeded", ranks=ranks, environment=environment, **common)


def _environment(cases: list[CaseOutcome]) -> EnvironmentInfo | None:
    parts = [c.environment for c in cases if c.environment is not None]
    return EnvironmentInfo.merge(parts) if parts else None
