"""Each rank result's resident-set peak, beside its allocator peak: the CPU peak meter now counts
the bytes c10's CPU allocator hands out (torch.cuda.max_memory_allocated's meaning), and the
process' RSS high-water mark above the baseline stays as a second, named figure. Results stored
before read NULL (their peak_memory_bytes was the resident figure).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    op.add_column("rank_result", sa.Column("resident_peak_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("rank_result", "resident_peak_bytes")
