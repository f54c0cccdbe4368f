"""A sweep's shared config stored once: sweep.base_config, and runs store only what differs.

A 0.5 MB request with a 500 KB env value over 200 cells wrote 103 MB, one copy per run. From
this revision a sweep keeps what all its runs' normalized configs share in base_config and each
run keeps the rest (run.config keeps its name). Sweeps stored before have base_config NULL and
runs with their whole config, which reads the same.

Create Date: 2026-11-24 16:00:00
"""

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"


def upgrade() -> None:
    # In place, not batch mode: see downgrade().
    op.add_column("sweep", sa.Column("base_config", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Runs of newer sweeps hold only their differences: give them their whole config back.
    sweep = sa.table("sweep", sa.column("id", sa.Integer), sa.column("base_config", sa.JSON))
    run = sa.table(
        "run", sa.column("id", sa.Integer), sa.column("sweep_id", sa.Integer),
        sa.column("config", sa.JSON),
    )  # fmt: skip
    conn = op.get_bind()
    bases = dict(conn.execute(sa.select(sweep.c.id, sweep.c.base_config)).all())
    for sweep_id, base in bases.items():
        if not base:
            continue
        rows = conn.execute(sa.select(run.c.id, run.c.config).where(run.c.sweep_id == sweep_id))
        for run_id, cell in rows.all():
            conn.execute(run.update().where(run.c.id == run_id).values(config={**base, **cell}))
    # Not batch mode: on SQLite it would rebuild the sweep table, and dropping the old one
    # cascades to every run. Both backends drop a column in place (SQLite since 3.35).
    op.drop_column("sweep", "base_config")
