"""The node each rank ran on (its Ray node's IP, from the gang's placement): where a usp run's
Ulysses groups sat (within a node or across nodes) is read from it. Ranks stored before read
NULL.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table; see 0005).
    op.add_column("rank_result", sa.Column("node", sa.String(255), nullable=True))


def downgrade() -> None:
    op.drop_column("rank_result", "node")
