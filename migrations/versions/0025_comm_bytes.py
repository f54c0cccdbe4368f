"""The K/V bytes each rank received and the share that carried no kept pair:
rank_result.comm_bytes and wasted_comm_bytes (the sharded kernel's own count from its mask and
token order: ring, allgather_kv under gather all or needed, usp's ring), and ring_step.skipped,
a ring step whose held K/V keep no pair with the rank's queries. Kernels that do not count
their bytes, and ranks and steps stored before, read NULL.

Create Date: 2026-12-07 16:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import add_columns, drop_columns

revision: str = "0025_comm_bytes"
down_revision: str | None = "0024_matmul_rate"


def upgrade() -> None:
    add_columns("rank_result", comm_bytes=sa.BigInteger(), wasted_comm_bytes=sa.BigInteger())
    add_columns("ring_step", skipped=sa.Boolean())


def downgrade() -> None:
    drop_columns("ring_step", "skipped")
    drop_columns("rank_result", "wasted_comm_bytes", "comm_bytes")
