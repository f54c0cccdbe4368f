"""The training-memory study: each model run's memory per component (predicted and measured),
its step time by phase and its predicted maximum length.

Create Date: 2026-11-24 12:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import add_columns, create_run_table, drop_columns, drop_run_table

revision: str = "0003"
down_revision: str | None = "0002"


def upgrade() -> None:
    add_columns(
        "rank_result",
        batch=True,
        forward_s=sa.Float(),
        backward_s=sa.Float(),
        optimizer_s=sa.Float(),
        predicted_max_seq_len=sa.BigInteger(),
    )
    create_run_table(
        "memory_component",
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("component", sa.String(32), nullable=False),
        sa.Column("predicted_bytes", sa.BigInteger(), nullable=True),
        sa.Column("measured_bytes", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("run_id", "rank", "component", name="uq_memory_component_run_rank"),
    )


def downgrade() -> None:
    drop_run_table("memory_component")
    columns = ("predicted_max_seq_len", "optimizer_s", "backward_s", "forward_s")
    drop_columns("rank_result", *columns, batch=True)
