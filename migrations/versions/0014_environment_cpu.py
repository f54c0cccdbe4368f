"""The host CPU's model name and logical CPU count in a run's environment: a CPU time compares
only on the same CPU, at the same thread count (cpu_threads, 0007). Environments stored before
read NULL.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 02:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    op.add_column("environment", sa.Column("cpu_model", sa.String(256), nullable=True))
    op.add_column("environment", sa.Column("cpu_cores", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("environment", "cpu_cores")
    op.drop_column("environment", "cpu_model")
