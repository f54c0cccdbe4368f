"""Concurrent gangs: which other runs shared a run's nodes while it ran (run.cotenants, a list of
run ids; NULL for runs stored before, or never placed), and when a sweep last had a run claimed
(sweep.last_claimed_at), which the scheduler's round-robin across sweeps orders by; and the
dashboard's server-side sessions (web_session: a logout revokes one, each expires).

Create Date: 2026-11-28 01:30:00
"""

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    op.add_column("run", sa.Column("cotenants", sa.JSON(), nullable=True))
    op.add_column("sweep", sa.Column("last_claimed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "web_session",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_web_session")),
        sa.UniqueConstraint("digest", name=op.f("uq_web_session_digest")),
    )


def downgrade() -> None:
    op.drop_table("web_session")
    op.drop_column("sweep", "last_claimed_at")
    op.drop_column("run", "cotenants")
