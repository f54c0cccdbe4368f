"""The torch CPU threads each rank ran with, in its environment: CPU times compare only at equal
counts (a CPU rank holds one Ray CPU and runs one thread). Environments stored before read NULL.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27 03:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    op.add_column("environment", sa.Column("cpu_threads", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("environment", "cpu_threads")
