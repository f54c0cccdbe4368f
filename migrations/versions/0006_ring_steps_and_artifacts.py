"""Where the time goes: every ring step's compute, wait and bytes per rank and iteration, each
rank's step totals, and the artifacts (profiler traces, memory snapshots) of a run; and the
kernel plugins of an environment.

Create Date: 2026-11-24 17:00:00
"""

import sqlalchemy as sa
from service.migrations import ops

revision: str = "0006"
down_revision: str | None = "0005"

# rank_result's ring-step totals and link rate, in the order they are added.
RANK_COLUMNS = {
    **ops.of_type(sa.Float(), "step_compute_s", "step_wait_s"),
    "step_received_bytes": sa.BigInteger(),
    "link_bytes_per_s": sa.Float(),
}


def upgrade() -> None:
    ops.add_columns("environment", batch=True, plugins=sa.JSON())
    ops.add_columns("rank_result", batch=True, **RANK_COLUMNS)
    ops.create_run_table(
        "ring_step",
        *ops.columns(sa.Integer(), "rank", "iteration"),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        *ops.columns(sa.Float(), "compute_s", "wait_s"),
        *ops.columns(sa.BigInteger(), "sent_bytes", "received_bytes"),
        sa.Column("link_bytes_per_s", sa.Float(), nullable=True),
    )
    ops.create_run_table(
        "artifact",
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        *ops.columns(sa.Text(), "location", "refused", nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("run_id", "name", name="uq_artifact_run_name"),
    )


def downgrade() -> None:
    ops.drop_run_table("artifact")
    ops.drop_run_table("ring_step")
    ops.drop_columns("rank_result", *reversed(RANK_COLUMNS), batch=True)
    ops.drop_columns("environment", "plugins", batch=True)
