"""Where the time goes: every ring step's compute, wait and bytes per rank and iteration, each
rank's step totals, and the artifacts (profiler traces, memory snapshots) of a run; and the
kernel plugins of an environment.

Create Date: 2026-11-24 17:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import add_columns, create_run_table, drop_columns, drop_run_table

revision: str = "0006"
down_revision: str | None = "0005"


def upgrade() -> None:
    add_columns("environment", batch=True, plugins=sa.JSON())
    add_columns(
        "rank_result",
        batch=True,
        step_compute_s=sa.Float(),
        step_wait_s=sa.Float(),
        step_received_bytes=sa.BigInteger(),
        link_bytes_per_s=sa.Float(),
    )
    create_run_table(
        "ring_step",
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
    create_run_table(
        "artifact",
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("location", sa.Text(), nullable=True),
        sa.Column("refused", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("run_id", "name", name="uq_artifact_run_name"),
    )


def downgrade() -> None:
    drop_run_table("artifact")
    drop_run_table("ring_step")
    columns = ("link_bytes_per_s", "step_received_bytes", "step_wait_s", "step_compute_s")
    drop_columns("rank_result", *columns, batch=True)
    drop_columns("environment", "plugins", batch=True)
