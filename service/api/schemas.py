"""Response models: what the API promises, published in its OpenAPI schema."""

from __future__ import annotations

from collections.abc import Collection
from copy import copy
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    create_model,
    model_validator,
)

from service.results.stored import StoredRank
from service.spec import SweepSpec
from workers import results
from workers.results import stored_fields


def _as_utc(value: datetime) -> datetime:
    # SQLite returns naive datetimes; every stored time is UTC (models.utcnow).
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]


COUNT_HELP = "Rows matching the filters: exact up to 10,000, then 10,000 with count_exact false."
NEXT_HELP = "Pass as `cursor` for the next page; null on the last page."


class Message(BaseModel):
    """An error or status message."""

    detail: str


WAITING_HELP = (
    "Queued runs only: why they cannot start now, when this service knows (its embedded "
    "scheduler cannot reach Ray, with Ray's reason, or it stopped); null otherwise."
)


class SweepOut(BaseModel):
    """A sweep with the number of its runs in each state and its progress."""

    id: int
    name: str
    kind: str
    spec: dict[str, Any]
    created_at: UtcDatetime
    idempotency_key: str | None
    submitter: str = Field(
        description="Who submitted it (X-Ringlab-Submitter; 'anonymous' when unnamed): the "
        "queue is fair across submitters first, then across sweeps."
    )
    total: int = Field(description="Number of runs.")
    counts: dict[str, int] = Field(description="Runs per state (every state listed).")
    finished: int = Field(description="Runs in a terminal state.")
    progress: float = Field(ge=0, le=1, description="finished / total.")
    done: bool = Field(description="Every run is in a terminal state.")
    waiting: str | None = Field(default=None, description=WAITING_HELP)


class SweepList(BaseModel):
    """A page of sweeps, how many match the filters in all, and where the next page starts."""

    data: list[SweepOut]
    count: int = Field(description=COUNT_HELP)
    count_exact: bool = Field(description="False when `count` stopped at its cap.")
    next: str | None = Field(description=NEXT_HELP)


class SweepAction(BaseModel):
    """The outcome of cancel or retry: how many runs changed, and the sweep after it."""

    changed: int
    sweep: SweepOut


MAX_DOCUMENTS = 100
"""Documents one submission may hold (a file's `---`-separated sweeps)."""


class SweepDocuments(BaseModel):
    """Several sweep specs submitted together (a file's documents): all stored in one
    transaction, or none."""

    model_config = ConfigDict(extra="forbid")

    documents: list[dict[str, Any]] = Field(
        min_length=1,
        max_length=MAX_DOCUMENTS,
        description="Sweep specs, each as a single submission takes it.",
        json_schema_extra={"items": {"$ref": "#/components/schemas/SweepSpec"}},
    )


class SweepBody(RootModel[SweepSpec | SweepDocuments]):
    """POST /sweeps: one sweep spec, or {"documents": [spec, ...]}.

    Each document is parsed on its own by the endpoint (SweepSpec), so that every problem of
    every document is listed under `documents.<i>`, not only the first document's."""

    @model_validator(mode="wrap")
    @classmethod
    def _dispatch(cls, data: Any, handler: Any) -> Any:
        """A body with `documents` is the envelope; anything else one spec, whose errors keep
        the paths a single submission has always had (no union member in them)."""
        if isinstance(data, dict) and "documents" in data:
            return handler(SweepDocuments.model_validate(data))
        return handler(SweepSpec.model_validate(data))


class SweepBatch(BaseModel):
    """The sweeps a multi-document submission stored, in the documents' order."""

    sweeps: list[SweepOut]


class CellsPlaced(BaseModel):
    """How many of a document's cells need one placement: what the cluster must hold."""

    device: str
    world_size: int
    placement: str
    cells: int


class DocumentCheck(BaseModel):
    """One document of a dry run: its cells and what is wrong with it."""

    index: int = Field(description="Its position in the submission, from 0.")
    name: str | None = Field(description="Its name, when it has one.")
    cells: int | None = Field(description="Cells (runs) it expands into; null if unreadable.")
    problems: list[dict[str, Any]] = Field(
        description="Errors as a 422 lists them (loc, msg, type); empty when it is valid."
    )
    placed: list[CellsPlaced] = Field(
        default_factory=list,
        description="Its cells counted by (device, world_size, placement), so a dry run can "
        "warn of runs the cluster could never hold; empty when it has problems.",
    )


class SweepCheck(BaseModel):
    """A dry run (?dry_run=true): every document checked and expanded, nothing stored."""

    valid: bool = Field(description="No document has a problem: submitting would store all.")
    documents: list[DocumentCheck]


class RunOut(BaseModel):
    """One run as listed: its cell, state and timing."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    sweep_id: int
    cell_key: str
    kernel: str
    seq_len: int
    world_size: int
    dtype: str
    mode: str
    causal: bool
    status: str
    attempts: int
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    error: str | None
    config: dict[str, Any]
    waiting: str | None = Field(default=None, description=WAITING_HELP)


class RunList(BaseModel):
    """A page of runs, how many match the filters in all, and where the next page starts."""

    data: list[RunOut]
    count: int | None = Field(description=COUNT_HELP + " Null when asked with count=false.")
    count_exact: bool = Field(description="False when `count` stopped at its cap (or is null).")
    next: str | None = Field(description=NEXT_HELP)


def stored_model(
    name: str,
    model: type[BaseModel],
    doc: str,
    nullable: Collection[str] = (),
    **extra: Any,
) -> type[BaseModel]:
    """The output model of a table generated from `model` (service.db.columns): its stored
    fields as workers.results declares them (type, default, description), read from the rows,
    and the `extra` fields the service keeps beside them (name=(type, Field(...))). nullable:
    fields rows stored before they existed hold as NULL."""
    fields: dict[str, Any] = {}
    for field in stored_fields(model):
        info = model.model_fields[field]
        annotation: Any = info.annotation
        if field in nullable:
            annotation = annotation | None
        fields[field] = (annotation, copy(info))
    config = ConfigDict(from_attributes=True)
    return create_model(name, __config__=config, __doc__=doc, **fields, **extra)


if TYPE_CHECKING:  # mypy reads the engine's models; the API's carry their stored fields
    RankResultOut = StoredRank
    ProbeOut = results.ProbeResult
    EnvironmentOut = results.EnvironmentInfo
    RingStepOut = results.StepTime
else:
    RankResultOut = stored_model(
        "RankResultOut",
        StoredRank,
        "What one rank measured (workers.results.RankResult's stored fields) and its node.",
    )
    ProbeOut = stored_model(
        "ProbeOut",
        results.ProbeResult,
        "One tried length of a max_seq_len search (workers.results.ProbeResult).",
        nullable={"rank_peak_bytes"},
    )
    EnvironmentOut = stored_model(
        "EnvironmentOut",
        results.EnvironmentInfo,
        "What a run ran on (workers.results.EnvironmentInfo), with its id and content hash.",
        nullable={"plugins", "plugin_code"},  # environments stored before 0006 and 0012
        id=(int, ...),
        hash=(str, Field(description="sha256 of its canonical JSON: the key it is kept by.")),
    )
    RingStepOut = stored_model(
        "RingStepOut",
        results.StepTime,
        "One step of a ring kernel on one rank in one timed iteration.",
        nullable={"skipped"},  # steps stored before 0024
        rank=(int, ...),
    )


class Headline(BaseModel):
    """A run's headline numbers (service.results.rows defines each; None where nothing was
    measured)."""

    measured_seq_len: int | None = Field(
        description="The length the ranks measured: seq_len, or a search's answer."
    )
    median_s: float | None = Field(description="Slowest rank's median time per iteration.")
    tokens_per_s: float | None = Field(description="batch_size * measured_seq_len / median_s.")
    tflops_per_s: float | None = Field(description="FLOPs summed over ranks / median_s / 1e12.")
    peak_memory_bytes: int | None = Field(
        description="Largest allocator peak over the ranks (CPU: c10's CPU allocator)."
    )
    resident_peak_bytes: int | None = Field(
        None, description="CPU: largest resident-set (RSS) high-water mark over the ranks."
    )
    max_seq_len: int | None = Field(description="max_seq_len runs: the longest length that fit.")
    exposed_comm_share: float | None = Field(
        description="Ring kernels: time blocked on transfers / time in steps, all ranks."
    )
    link_probe_bytes_per_s: float | None = Field(
        description="W > 1 sequence parallel: the slowest rank's probed ring link bandwidth."
    )
    link_kind: str | None = Field(
        description="What that link was: loopback (one host), one host (GPU to GPU), network."
    )


class ArtifactOut(BaseModel):
    """A file a run produced; `refused` says why its bytes were not kept."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    kind: str = Field(description="chrome_trace (Perfetto, chrome://tracing) | memory_snapshot")
    rank: int | None
    size_bytes: int
    refused: str | None
    created_at: UtcDatetime
    url: str | None = Field(description="Where to download it (None when refused).")


class RunDetail(RunOut):
    """A run with everything measured for it."""

    lease_owner: str | None
    heartbeat_at: UtcDatetime | None
    cotenants: list[int] | None = Field(
        description="Ids of the runs whose gangs shared a node with this one while it ran "
        "(its timings may be contended); []: it ran alone; null: never placed, or stored "
        "before co-tenants were recorded."
    )
    rank_results: list[RankResultOut]
    probes: list[ProbeOut]
    environment: EnvironmentOut | None
    headline: Headline


class KernelOut(BaseModel):
    """A kernel of the catalogue and the JSON schema of its parameters; a plugin's kernels say
    their package and version, and a plugin that failed to load is listed unavailable."""

    name: str
    description: str
    distributed: bool
    params_schema: dict[str, Any] | None = Field(description="None when unavailable.")
    available: bool = True
    error: str | None = Field(None, description="Why an unavailable plugin did not load.")
    package: str | None = Field(None, description="Plugins: the package that provides it.")
    version: str | None = Field(None, description="Plugins: that package's version.")
    masks: list[str] = Field(
        default_factory=list,
        description="The mask kinds it runs exactly (a run's params.mask; causal and full by "
        "its `causal` flag); empty when unavailable.",
    )
    balances: list[str] = Field(
        default_factory=list, description="The balances its params.balance takes (none: empty)."
    )


class HealthOut(BaseModel):
    """Liveness or readiness: `ok` or `unavailable`, with one line per check."""

    status: str
    checks: dict[str, str] = Field(default_factory=dict)


class ClusterNode(BaseModel):
    node_id: str
    ip: str
    hostname: str
    cpus: float
    gpus: float
    gpu_names: list[str]
    free_cpus: float
    free_gpus: float


class ClusterOut(BaseModel):
    """The Ray cluster: alive nodes, their CPUs and GPUs, and what is free now."""

    nodes: list[ClusterNode]
    total_cpus: float
    total_gpus: float
    free_cpus: float
    free_gpus: float
    gang_cpus: float = Field(description="Reserved by ringlab's gangs, running or warm.")
    gang_gpus: float = Field(description="Reserved by ringlab's gangs, running or warm.")
    idle_gang_cpus: float = Field(
        description="Reserved by warm gangs that run nothing now: the next run of the same "
        "shape reuses them, and another run gets them back when it needs them."
    )
    idle_gang_gpus: float = Field(description="As idle_gang_cpus, for GPUs.")


class ComparePair(BaseModel):
    """One cell run in both sweeps: B against A (service.results.compare.compare_rows)."""

    label: str
    a_run_id: int
    b_run_id: int
    tps_ratio: float | None = Field(description="B tokens/s / A tokens/s.")
    tps_lo: float | None = Field(description="Its interval from both medians': b_lo / a_hi.")
    tps_hi: float | None = Field(description="b_hi / a_lo.")
    within_noise: bool = Field(description="The interval holds 1.0.")
    time_change: Literal["slower", "faster"] | None = Field(
        description="B's median interval wholly above (slower) or below A's, both intervals at "
        "95% or more; None: overlapping (noise), or too few iterations to tell."
    )
    time_verdict: (
        Literal["slower", "faster", "within noise", "too few iterations to tell"] | None
    ) = Field(
        None,
        description="The time's verdict: too few iterations to tell when either run's interval "
        "is missing (1 iteration) or covers less than 95% (2-5 iterations); None without a "
        "time in both.",
    )
    memory_ratio: float | None = Field(description="B peak / A peak (one measurement each).")
    max_len_ratio: float | None = Field(description="B max length / A max length.")
    regression: bool
    reasons: list[str] = Field(description="slower, more memory, shorter max length, B <status>.")
    time_ratio: float | None = Field(None, description="B median_s / A median_s.")
    a_status: str | None = Field(None, description="A's run status.")
    b_status: str | None = Field(None, description="B's run status.")
    a_median_s: float | None = Field(None, description="A's slowest rank's median time.")
    b_median_s: float | None = Field(None, description="B's slowest rank's median time.")
    a_tokens_per_s: float | None = Field(
        None, description="A's tokens/s: batch_size * measured_seq_len / median_s."
    )
    b_tokens_per_s: float | None = Field(None, description="B's tokens/s.")
    a_peak_memory_bytes: int | None = Field(None, description="A's largest per-rank peak.")
    b_peak_memory_bytes: int | None = Field(None, description="B's largest per-rank peak.")
    a_max_seq_len: int | None = Field(
        None, description="max_seq_len runs: the longest length that fit in A."
    )
    b_max_seq_len: int | None = Field(None, description="The longest length that fit in B.")
    a_iterations: int | None = Field(None, description="A's timed iterations.")
    b_iterations: int | None = Field(None, description="B's timed iterations.")
    a_median_ci_level: float | None = Field(None, description="What A's interval covers.")
    b_median_ci_level: float | None = Field(None, description="What B's interval covers.")


class CompareOut(BaseModel):
    """Two sweeps cell by cell (the /compare page's data)."""

    a: int
    b: int
    same_spec: bool = Field(description="Both specs are identical once their names are dropped.")
    only_a: int = Field(description="Cells only in A.")
    only_b: int = Field(description="Cells only in B.")
    regressions: int
    within_noise: int
    too_few: int = Field(0, description="Pairs whose time is too few iterations to tell.")
    pairs: list[ComparePair]


class CellHistoryEntry(BaseModel):
    """One run of the cell (service.history)."""

    run_id: int
    sweep_id: int
    sweep_name: str
    status: str
    at: datetime = Field(description="When it finished (started, or was queued, if not yet).")
    median_s: float | None = Field(description="Slowest rank's median time per iteration.")
    median_lo_s: float | None = Field(description="Its interval's lower end.")
    median_hi_s: float | None = Field(description="Its interval's upper end.")
    median_ci_level: float | None = Field(
        None, description="What that interval covers: 95% or more from 6 iterations, less below."
    )
    iterations: int | None = Field(None, description="Timed iterations run.")
    tokens_per_s: float | None
    peak_memory_bytes: int | None = Field(description="Largest allocator peak over the ranks.")
    environment_id: int | None
    git_sha: str | None = Field(description="The ringlab checkout's commit that ran it.")
    git_dirty: bool | None = Field(description="Whether that checkout had local changes.")
    plugin_code: dict[str, Any] | None = Field(
        description="Plugins installed editable from a checkout: package -> {git_sha, "
        "git_dirty, path}."
    )


class CellHistoryOut(BaseModel):
    """One cell across every sweep that ran it, oldest first."""

    cell: dict[str, Any] = Field(
        description="The cell: its run config without the fields that do not change what is "
        "measured (name, tags, timeouts, iterations)."
    )
    truncated: bool = Field(description="More runs exist than the newest ones returned.")
    entries: list[CellHistoryEntry]
