"""The correctness gate's sampled check at a run's own length: its error, length and rows,
beside the full check's (max_abs_error, check_seq_len). Results stored before read NULL.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("sampled_check_error", sa.Float()),
    ("sampled_check_seq_len", sa.BigInteger()),
    ("sampled_check_rows", sa.Integer()),
)


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    for name, kind in COLUMNS:
        op.add_column("rank_result", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("rank_result", name)
