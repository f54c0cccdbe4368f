"""The code version of each kernel plugin installed editable from a git checkout (package ->
{git_sha, git_dirty, path}) in a run's environment, beside the project's own git_sha and
git_dirty: a plugin's version string does not change with its code. Environments stored before
read NULL.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 01:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    op.add_column("environment", sa.Column("plugin_code", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("environment", "plugin_code")
