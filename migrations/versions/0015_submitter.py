"""Who submitted a sweep (a self-declared name: the X-Ringlab-Submitter header, the CLI's
--as or RINGLAB_SUBMITTER): the queue round-robins across submitters first, then across each
submitter's sweeps (service.leases). Sweeps stored before read 'anonymous'.

Create Date: 2026-11-28 18:00:00
"""

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"


def upgrade() -> None:
    # In place, not batch mode (which on SQLite rebuilds the table runs refer to; see 0005).
    op.add_column(
        "sweep",
        sa.Column("submitter", sa.String(64), nullable=False, server_default="anonymous"),
    )


def downgrade() -> None:
    op.drop_column("sweep", "submitter")
