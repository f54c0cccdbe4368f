"""The training-memory study: each model run's memory per component (predicted and measured),
its step time by phase and its predicted maximum length.

Create Date: 2026-11-24 12:00:00
"""

import sqlalchemy as sa
from service.migrations import ops

revision: str = "0003"
down_revision: str | None = "0002"

# rank_result's step time by phase and predicted maximum length, in the order they are added.
RANK_COLUMNS = {
    **ops.of_type(sa.Float(), "forward_s", "backward_s", "optimizer_s"),
    "predicted_max_seq_len": sa.BigInteger(),
}


def upgrade() -> None:
    ops.add_columns("rank_result", batch=True, **RANK_COLUMNS)
    ops.create_run_table(
        "memory_component",
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("component", sa.String(32), nullable=False),
        *ops.columns(sa.BigInteger(), "predicted_bytes", "measured_bytes", nullable=True),
        sa.UniqueConstraint("run_id", "rank", "component", name="uq_memory_component_run_rank"),
    )


def downgrade() -> None:
    ops.drop_run_table("memory_component")
    ops.drop_columns("rank_result", *reversed(RANK_COLUMNS), batch=True)
