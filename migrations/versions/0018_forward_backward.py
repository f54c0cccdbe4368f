"""Forward and backward apart for kernel cells in train mode: each rank's forward and backward
times of every timed iteration, their spreads (p10, p90; the medians forward_s and backward_s
exist since model runs stored them) and the kernel's forward FLOPs. Ranks stored before read
NULL.

Revision ID: 0018_forward_backward
Revises: 0017_listing_indexes
Create Date: 2026-11-28 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018_forward_backward"
down_revision: str | None = "0017_listing_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("forward_p10_s", sa.Float()),
    ("forward_p90_s", sa.Float()),
    ("backward_p10_s", sa.Float()),
    ("backward_p90_s", sa.Float()),
    ("forward_times_s", sa.JSON()),
    ("backward_times_s", sa.JSON()),
    ("forward_flops", sa.Float()),
)


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table; see 0005).
    for name, kind in COLUMNS:
        op.add_column("rank_result", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("rank_result", name)
