"""A measured ring link: before its timed loop a sequence-parallel run over W > 1 ranks pings one
K/V block to each rank's next ring neighbour and back (workers.link); each rank stores the block's
bytes, the link's bandwidth and its latency. The figure the runs stored until now as
link_bytes_per_s (a transfer's bytes over its window, which includes waiting for the peer) keeps
its values under the name of what it is: transfer_window_bytes_per_s. Rank results stored before
read NULL for the new columns.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RENAMED = ("rank_result", "ring_step")


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    for table in RENAMED:
        op.alter_column(table, "link_bytes_per_s", new_column_name="transfer_window_bytes_per_s")
    op.add_column("rank_result", sa.Column("link_probe_bytes", sa.BigInteger(), nullable=True))
    op.add_column("rank_result", sa.Column("link_probe_bytes_per_s", sa.Float(), nullable=True))
    op.add_column("rank_result", sa.Column("link_latency_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("rank_result", "link_latency_s")
    op.drop_column("rank_result", "link_probe_bytes_per_s")
    op.drop_column("rank_result", "link_probe_bytes")
    for table in RENAMED:
        op.alter_column(table, "transfer_window_bytes_per_s", new_column_name="link_bytes_per_s")
