"""SQLAlchemy 2 typed models: sweeps, their runs, per-rank results, probes and environments.

What a rank measures is declared once, in workers/results.py: the columns of rank_result,
probe, memory_component and ring_step are generated from its models (service.db.columns); this
module adds only what the service keeps beside them (ids, the run, the node). Raw units only:
bytes, seconds, FLOPs. JSON columns hold what users submitted verbatim; the
columns users filter by are copied out of it and indexed.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from service.db.columns import columns_of
from workers import results

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """Timezone-aware now, the only clock the models use."""
    return datetime.now(UTC)


def full_config(base: dict[str, Any] | None, cell: dict[str, Any]) -> dict[str, Any]:
    """A run's whole config from its sweep's base_config and its cell_config."""
    return {**base, **cell} if base else dict(cell)


RUN_CONFIG_COLUMNS = ("kernel", "seq_len", "world_size", "dtype", "mode", "causal")
"""The run config's fields the run table copies into columns of their own (indexed, filtered)."""


def run_config_columns(config: Any) -> dict[str, Any]:
    """Those columns of a run from its config (a workers.config.RunConfig): the one place
    that says which config fields the table repeats."""
    return {name: getattr(config, name) for name in RUN_CONFIG_COLUMNS}


def cell_delta(base: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What a run stores of its whole config: the keys whose values differ from base
    (full_config(base, cell_delta(base, c)) == c when c and base share their keys)."""
    out = {}
    for key, value in config.items():
        shared = base.get(key, _MISSING)
        if shared is value:
            continue
        kind = type(value)
        if kind is type(shared) and kind is not dict and kind is not list and shared == value:
            continue  # the common case, a scalar: no call (a 100,000-cell POST makes 2.8M)
        if not same_json(shared, value):
            out[key] = value
    return out


_MISSING = object()


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: unlike ==, 1, 1.0 and true differ (each is stored as itself)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


DEFAULT_SUBMITTER = "anonymous"
"""The submitter of a sweep posted without naming one (and of sweeps stored before 0015)."""
SUBMITTER_PATTERN = r"^[A-Za-z0-9._@+-]{1,64}$"
"""What a submitter's name may hold: a user or e-mail name, no spaces or control characters."""


class SweepKind(enum.StrEnum):
    benchmark = "benchmark"
    max_seq_len = "max_seq_len"
    correctness = "correctness"


class RunStatus(enum.StrEnum):
    queued = "queued"
    waiting_resources = "waiting_resources"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    oom = "oom"
    cancelled = "cancelled"
    timed_out = "timed_out"


TERMINAL_STATUSES = frozenset(
    {RunStatus.succeeded, RunStatus.failed, RunStatus.oom, RunStatus.cancelled, RunStatus.timed_out}
)
ACTIVE_STATUSES = (RunStatus.running, RunStatus.waiting_resources)
"""Runs a scheduler holds under a lease: a sweep with one cannot be deleted."""


class ProbeOutcome(enum.StrEnum):
    fit = "fit"
    oom = "oom"
    error = "error"


def _enum(cls: type[enum.Enum], name: str) -> Enum:
    # Stored as plain strings (no native PG enum) so adding a state is a one-line migration.
    return Enum(cls, name=name, native_enum=False, length=32, validate_strings=True)


class Sweep(Base):
    __tablename__ = "sweep"
    __table_args__ = ({"sqlite_autoincrement": True},)
    """Ids are never reused (on SQLite too, since 0021): a deleted sweep's id names no other
    sweep, so a bookmark, a report's "sweep 6" or an export's folder keeps meaning one thing."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[SweepKind] = mapped_column(_enum(SweepKind, "sweep_kind"))
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    base_config: Mapped[dict[str, Any] | None]
    """What every run's normalized config shares, stored once (None: sweeps stored before
    revision 0005, whose runs hold their whole config). See Run.config."""
    last_claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    """When a scheduler last claimed one of its runs: the queue serves the sweep claimed
    longest ago first (round-robin across sweeps, within their submitter: service.leases)."""
    submitter: Mapped[str] = mapped_column(
        String(64), default=DEFAULT_SUBMITTER, server_default=DEFAULT_SUBMITTER
    )
    """Who submitted it, as they named themselves (X-Ringlab-Submitter, the CLI's --as): not
    an authenticated identity (there is one API token), a label the queue is fair across:
    round-robin across submitters first, then across each one's sweeps (revision 0015)."""

    runs: Mapped[list[Run]] = relationship(
        back_populates="sweep", cascade="all, delete-orphan", passive_deletes=True
    )


class Environment(Base):
    """What a run ran on; deduplicated by a hash of its content."""

    __tablename__ = "environment"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    hosts: Mapped[list[Any]]
    gpus: Mapped[list[Any]]
    driver: Mapped[str | None] = mapped_column(String(64))
    cuda: Mapped[str | None] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(64))
    nccl: Mapped[str | None] = mapped_column(String(64))
    ray: Mapped[str | None] = mapped_column(String(64))
    python: Mapped[str] = mapped_column(String(64))
    git_sha: Mapped[str | None] = mapped_column(String(64))
    git_dirty: Mapped[bool | None] = mapped_column(Boolean)
    plugins: Mapped[dict[str, Any] | None]
    """Kernel plugins installed (attention.plugins): package -> version."""
    cpu_threads: Mapped[int | None] = mapped_column(Integer)
    """torch's intra-op CPU threads in each rank (workers.results.EnvironmentInfo)."""
    cpu_model: Mapped[str | None] = mapped_column(String(256))
    """The host CPU's model name (workers.environment.cpu_model)."""
    cpu_cores: Mapped[int | None] = mapped_column(Integer)
    """Logical CPUs of the host."""
    matmul_dtype: Mapped[str | None] = mapped_column(String(32))
    """The dtype of the node's matmul probe (workers.matmul_probe)."""
    matmul_size: Mapped[int | None] = mapped_column(Integer)
    """Side n of the probe's square product."""
    matmul_s: Mapped[float | None] = mapped_column(Float)
    """The probe's best seconds for one product."""
    matmul_flops_per_s: Mapped[float | None] = mapped_column(Float)
    """The node's measured matmul rate, 2 n^3 / matmul_s."""
    plugin_code: Mapped[dict[str, Any] | None]
    """package -> {git_sha, git_dirty, path} of each plugin installed editable from a checkout."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Run(Base):
    """One cell of a sweep's grid, and its life from queued to a terminal state."""

    __tablename__ = "run"
    __table_args__ = (
        UniqueConstraint("sweep_id", "cell_key", name="uq_run_sweep_id_cell_key"),
        Index("ix_run_status_id", "status", "id"),
        # Every prefix of the list filters, sorted by length; counts read only the index.
        # Pages by offset (migrations 0011, 0017): a filter's rows in the page's order
        # (column, id), straight from an index, so `skip` steps over index entries, not over
        # other filters' rows nor over table rows read to break ties by id.
        Index(
            "ix_run_kernel_status_world_size_seq_len_id",
            *("kernel", "status", "world_size", "seq_len", "id"),
        ),
        Index("ix_run_kernel_status_world_size_id", "kernel", "status", "world_size", "id"),
        Index("ix_run_sweep_id_status_id", "sweep_id", "status", "id"),
        Index("ix_run_sweep_id_id", "sweep_id", "id"),
        Index("ix_run_kernel_id", "kernel", "id"),
        Index("ix_run_status_seq_len_id", "status", "seq_len", "id"),
        Index("ix_run_dtype_seq_len_id", "dtype", "seq_len", "id"),
        {"sqlite_autoincrement": True},  # ids never reused, like the sweep's (0021)
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweep.id", ondelete="CASCADE"))
    cell_key: Mapped[str] = mapped_column(String(64))
    cell_config: Mapped[dict[str, Any]] = mapped_column("config")
    """The keys of the run's normalized config whose values differ from its sweep's
    base_config: a 100,000-cell sweep stores its shared env and params once, not per run."""
    kernel: Mapped[str] = mapped_column(String(64))
    seq_len: Mapped[int] = mapped_column(BigInteger, index=True)
    world_size: Mapped[int] = mapped_column(Integer, index=True)
    dtype: Mapped[str] = mapped_column(String(16))
    mode: Mapped[str] = mapped_column(String(16))
    causal: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[RunStatus] = mapped_column(
        _enum(RunStatus, "run_status"), default=RunStatus.queued
    )
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)
    environment_id: Mapped[int | None] = mapped_column(
        ForeignKey("environment.id", ondelete="SET NULL")
    )
    cotenants: Mapped[list[Any] | None]
    """Ids of the other runs whose gangs shared a node with this run's gang while it ran
    ([]: it ran alone; None: never placed, or stored before revision 0013). A timing taken
    beside a co-tenant may be contended."""

    sweep: Mapped[Sweep] = relationship(back_populates="runs")
    environment: Mapped[Environment | None] = relationship()

    @property
    def config(self) -> dict[str, Any]:
        """The run's whole normalized config (RunConfig.model_dump(mode="json")): its sweep's
        base_config overlaid with its own cell_config."""
        return full_config(self.sweep.base_config if self.sweep else None, self.cell_config)

    @config.setter
    def config(self, value: dict[str, Any]) -> None:
        # A whole config stored as the cell is still exact: it overrides every base key.
        self.cell_config = value

    rank_results: Mapped[list[RankResultRow]] = relationship(
        back_populates="run",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="RankResultRow.rank",
    )
    probes: Mapped[list[Probe]] = relationship(
        back_populates="run",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="Probe.id",
    )


def _run_rows(name: str, *columns: Any) -> Table:
    """A table of rows that belong to a run: their id, the run's (deleted with it), `columns`."""
    return Table(
        name,
        Base.metadata,
        Column("id", Integer, primary_key=True),
        Column("run_id", ForeignKey("run.id", ondelete="CASCADE"), nullable=False, index=True),
        *columns,
    )


rank_result_table = _run_rows(
    "rank_result",
    *columns_of(
        results.RankResult,
        {"rank": Integer(), "sampled_check_rows": Integer(), "backend": String(64)},
    ),
    Column("node", String(255), doc="The node the rank ran on (its Ray node's IP; 0016)."),
    UniqueConstraint("run_id", "rank", name="uq_rank_result_run_id_rank"),
)


class RankResultRow(Base):
    """What one rank measured for one run: the stored fields of workers.results.RankResult
    (their columns generated from it), and the node it ran on."""

    __table__ = rank_result_table

    id: Mapped[int]
    run_id: Mapped[int]
    rank: Mapped[int]  # typed for the queries that order by it; declared in workers.results
    node: Mapped[str | None]

    run: Mapped[Run] = relationship(back_populates="rank_results")


memory_component_table = _run_rows(
    "memory_component",
    Column("rank", Integer, nullable=False),
    *columns_of(results.MemoryComponent, {"component": String(32)}),
    UniqueConstraint("run_id", "rank", "component", name="uq_memory_component_run_rank"),
)


class MemoryComponentRow(Base):
    """One memory component of a model run on one rank (workers.results.MemoryComponent)."""

    __table__ = memory_component_table

    id: Mapped[int]
    run_id: Mapped[int]
    rank: Mapped[int]


probe_table = _run_rows(
    "probe",
    *columns_of(
        results.ProbeResult,
        {"outcome": _enum(ProbeOutcome, "probe_outcome")},
        nullable={"rank_peak_bytes"},  # probes stored before 0002
    ),
)


class Probe(Base):
    """One tried length of a max_seq_len search (workers.results.ProbeResult)."""

    __table__ = probe_table

    id: Mapped[int]
    run_id: Mapped[int]

    run: Mapped[Run] = relationship(back_populates="probes")


ring_step_table = _run_rows(
    "ring_step",
    Column("rank", Integer, nullable=False),
    *columns_of(
        results.StepTime,
        {"iteration": Integer(), "phase": String(16), "step": Integer()},
        nullable={"skipped"},  # steps stored before 0024
    ),
)


class RingStep(Base):
    """One step of a ring kernel on one rank in one timed iteration (workers.results.StepTime)."""

    __table__ = ring_step_table

    id: Mapped[int]
    run_id: Mapped[int]
    rank: Mapped[int]


class ArtifactRow(Base):
    """A file a run produced (a profiler trace, a memory snapshot), written by the scheduler
    under the artifact root (service.artifacts); `refused` says why its bytes were not kept."""

    __tablename__ = "artifact"
    __table_args__ = (UniqueConstraint("run_id", "name", name="uq_artifact_run_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    location: Mapped[str | None] = mapped_column(Text)
    """Where the bytes are: a path or fsspec URL under the artifact root (None if refused)."""
    refused: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


RUN_RESULT_TABLES: tuple[
    type[RankResultRow | Probe | MemoryComponentRow | RingStep | ArtifactRow], ...
] = (
    RankResultRow,
    Probe,
    MemoryComponentRow,
    RingStep,
    ArtifactRow,
)
"""The tables of a run's results, each keyed by run_id: what a retry deletes, so that the new
attempt's numbers stand alone."""


class WebSession(Base):
    """A dashboard login (service.api.sessions): the cookie holds a random id and an HMAC of
    it under the API token; the table holds the id's SHA-256, so a logout (the row deleted)
    or its expiry ends the session for real, and a database read does not yield cookies."""

    __tablename__ = "web_session"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
