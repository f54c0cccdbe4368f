"""initial schema

Create Date: 2026-11-22 07:33:35.867718
"""

import sqlalchemy as sa
from alembic import op
from service.migrations.ops import columns

revision: str = "0001"
down_revision: str | None = None

# sweep.kind's and run.status's values at this revision.
SWEEP_KINDS = ("benchmark", "max_seq_len", "correctness")
RUN_STATUSES = (
    "queued",
    "waiting_resources",
    "running",
    "succeeded",
    "failed",
    "oom",
    "cancelled",
    "timed_out",
)

# Each indexed alone, as ix_run_<column>.
RUN_INDEXED = ("dtype", "kernel", "seq_len", "status", "sweep_id", "world_size")


def _create_run_table(name: str, *items: sa.schema.SchemaItem) -> None:
    """Create table `name` of per-run rows: an integer id, the run (deleted with it), then
    `items`; its constraints named pk_<name> and fk_<name>_run_id_run, and indexed by run."""
    op.create_table(
        name,
        *columns(sa.Integer(), "id", "run_id"),
        *items,
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f(f"fk_{name}_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{name}")),
    )
    _create_indexes(name, "run_id")


def _create_indexes(table: str, *names: str) -> None:
    """An index ix_<table>_<column> on each column of `names`, one by one."""
    for column in names:
        op.create_index(op.f(f"ix_{table}_{column}"), table, [column], unique=False)


def _drop_indexes(table: str, *names: str) -> None:
    """Drop what _create_indexes made for the columns `names`, in that order."""
    for column in names:
        op.drop_index(op.f(f"ix_{table}_{column}"), table_name=table)


def _string_enum(name: str, *values: str) -> sa.Enum:
    """An enum stored as a string of at most 32 characters (no database enum type)."""
    return sa.Enum(*values, name=name, native_enum=False, length=32)


def upgrade() -> None:
    op.create_table(
        "environment",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        *columns(sa.JSON(), "hosts", "gpus"),
        *columns(sa.String(length=64), "driver", "cuda", nullable=True),
        sa.Column("torch", sa.String(length=64), nullable=False),
        *columns(sa.String(length=64), "nccl", "ray", nullable=True),
        sa.Column("python", sa.String(length=64), nullable=False),
        sa.Column("git_sha", sa.String(length=64), nullable=True),
        sa.Column("git_dirty", sa.Boolean(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_environment")),
        sa.UniqueConstraint("hash", name=op.f("uq_environment_hash")),
    )
    op.create_table(
        "sweep",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", _string_enum("sweep_kind", *SWEEP_KINDS), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_sweep_idempotency_key")),
    )
    op.create_table(
        "run",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("cell_key", sa.String(length=64), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("kernel", sa.String(length=64), nullable=False),
        sa.Column("seq_len", sa.BigInteger(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        *columns(sa.String(length=16), "dtype", "mode"),
        sa.Column("causal", sa.Boolean(), nullable=False),
        sa.Column("status", _string_enum("run_status", *RUN_STATUSES), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        *columns(sa.DateTime(timezone=True), "lease_expires_at", "heartbeat_at", nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        *columns(sa.DateTime(timezone=True), "started_at", "finished_at", nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("environment_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["environment_id"],
            ["environment.id"],
            name=op.f("fk_run_environment_id_environment"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweep.id"], name=op.f("fk_run_sweep_id_sweep"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run")),
        sa.UniqueConstraint("sweep_id", "cell_key", name="uq_run_sweep_id_cell_key"),
    )
    _create_indexes("run", *RUN_INDEXED)
    op.create_index("ix_run_status_id", "run", ["status", "id"], unique=False)
    _create_run_table(
        "probe",
        sa.Column("seq_len", sa.BigInteger(), nullable=False),
        sa.Column("outcome", _string_enum("probe_outcome", "fit", "oom", "error"), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("time_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("emulated", sa.Boolean(), nullable=False),
    )
    _create_run_table(
        "rank_result",
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("times_s", sa.JSON(), nullable=False),
        *columns(sa.Float(), "median_s", "p10_s", "p90_s", "tokens_per_s", "flops", "flops_per_s"),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_budget_bytes", sa.BigInteger(), nullable=True),
        sa.Column("backend", sa.String(length=64), nullable=False),
        sa.Column("max_abs_error", sa.Float(), nullable=True),
        sa.UniqueConstraint("run_id", "rank", name="uq_rank_result_run_id_rank"),
    )


def downgrade() -> None:
    for table in ("rank_result", "probe"):
        _drop_indexes(table, "run_id")
        op.drop_table(table)
    op.drop_index("ix_run_status_id", table_name="run")
    _drop_indexes("run", *reversed(RUN_INDEXED))
    op.drop_table("run")
    op.drop_table("sweep")
    op.drop_table("environment")
