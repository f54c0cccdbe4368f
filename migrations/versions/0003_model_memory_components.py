"""The training-memory study: each model run's memory per component (predicted and measured),
its step time by phase and its predicted maximum length.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rank_result") as batch:
        batch.add_column(sa.Column("forward_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("backward_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("optimizer_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("predicted_max_seq_len", sa.BigInteger(), nullable=True))
    op.create_table(
        "memory_component",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("run.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("component", sa.String(32), nullable=False),
        sa.Column("predicted_bytes", sa.BigInteger(), nullable=True),
        sa.Column("measured_bytes", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("run_id", "rank", "component", name="uq_memory_component_run_rank"),
    )
    op.create_index("ix_memory_component_run_id", "memory_component", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_memory_component_run_id", table_name="memory_component")
    op.drop_table("memory_component")
    with op.batch_alter_table("rank_result") as batch:
        batch.drop_column("predicted_max_seq_len")
        batch.drop_column("optimizer_s")
        batch.drop_column("backward_s")
        batch.drop_column("forward_s")
