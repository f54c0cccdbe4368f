"""Where the time goes: every ring step's compute, wait and bytes per rank and iteration, each
rank's step totals, and the artifacts (profiler traces, memory snapshots) of a run; and the
kernel plugins of an environment.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("environment") as batch:
        batch.add_column(sa.Column("plugins", sa.JSON(), nullable=True))
    with op.batch_alter_table("rank_result") as batch:
        batch.add_column(sa.Column("step_compute_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("step_wait_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("step_received_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("link_bytes_per_s", sa.Float(), nullable=True))
    op.create_table(
        "ring_step",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("run.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("compute_s", sa.Float(), nullable=False),
        sa.Column("wait_s", sa.Float(), nullable=False),
        sa.Column("sent_bytes", sa.BigInteger(), nullable=False),
        sa.Column("received_bytes", sa.BigInteger(), nullable=False),
        sa.Column("link_bytes_per_s", sa.Float(), nullable=True),
    )
    op.create_index("ix_ring_step_run_id", "ring_step", ["run_id"])
    op.create_table(
        "artifact",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("run.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("location", sa.Text(), nullable=True),
        sa.Column("refused", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("run_id", "name", name="uq_artifact_run_name"),
    )
    op.create_index("ix_artifact_run_id", "artifact", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_artifact_run_id", table_name="artifact")
    op.drop_table("artifact")
    op.drop_index("ix_ring_step_run_id", table_name="ring_step")
    op.drop_table("ring_step")
    with op.batch_alter_table("rank_result") as batch:
        batch.drop_column("link_bytes_per_s")
        batch.drop_column("step_received_bytes")
        batch.drop_column("step_wait_s")
        batch.drop_column("step_compute_s")
    with op.batch_alter_table("environment") as batch:
        batch.drop_column("plugins")
