"""Indexes for run lists at a million runs: filters that combine, and counts from the index.

GET /runs filtered by kernel, state and world size and sorted by length took 150-600 ms at
1,000,000 runs: three single-column indexes were ANDed as bitmaps, and the sorted page walked
the seq_len index throwing away the rows of other kernels. One composite index in the order of
the filters (kernel, status, world_size, seq_len) answers every prefix of them, sorted by length,
and counts them without reading the table; it replaces the index on kernel alone. Likewise
(sweep_id, status) replaces the index on sweep_id alone: one sweep's runs in a given state.

Create Date: 2026-11-24 15:00:00
"""

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"

FILTERS = ["kernel", "status", "world_size", "seq_len"]


def upgrade() -> None:
    op.create_index("ix_run_kernel_status_world_size_seq_len", "run", FILTERS)
    op.drop_index("ix_run_kernel", table_name="run")
    op.create_index("ix_run_sweep_id_status", "run", ["sweep_id", "status"])
    op.drop_index("ix_run_sweep_id", table_name="run")


def downgrade() -> None:
    op.create_index("ix_run_sweep_id", "run", ["sweep_id"])
    op.drop_index("ix_run_sweep_id_status", table_name="run")
    op.create_index("ix_run_kernel", "run", ["kernel"])
    op.drop_index("ix_run_kernel_status_world_size_seq_len", table_name="run")
