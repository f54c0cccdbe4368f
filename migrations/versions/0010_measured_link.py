"""A measured ring link: before its timed loop a sequence-parallel run over W > 1 ranks pings one
K/V block to each rank's next ring neighbour and back (workers.link); each rank stores the block's
bytes, the link's bandwidth and its latency. The figure the runs stored until now as
link_bytes_per_s (a transfer's bytes over its window, which includes waiting for the peer) keeps
its values under the name of what it is: transfer_window_bytes_per_s. Rank results stored before
read NULL for the new columns.

Create Date: 2026-11-27 23:00:00
"""

import sqlalchemy as sa
from alembic import op
from service.migrations.ops import add_columns, drop_columns

revision: str = "0010"
down_revision: str | None = "0009"

RENAMED = ("rank_result", "ring_step")


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    for table in RENAMED:
        op.alter_column(table, "link_bytes_per_s", new_column_name="transfer_window_bytes_per_s")
    add_columns(
        "rank_result",
        link_probe_bytes=sa.BigInteger(),
        link_probe_bytes_per_s=sa.Float(),
        link_latency_s=sa.Float(),
    )


def downgrade() -> None:
    drop_columns("rank_result", "link_latency_s", "link_probe_bytes_per_s", "link_probe_bytes")
    for table in RENAMED:
        op.alter_column(table, "transfer_window_bytes_per_s", new_column_name="link_bytes_per_s")
