"""Ids are never reused: sweep and run ids on SQLite come from AUTOINCREMENT.

Without it SQLite gives a new row the largest id + 1, so deleting the newest sweep handed its
id (and its runs' ids) to the next submission: bookmarks, a report's "sweep 6" and export
folders then named another experiment. Postgres's sequences never reuse ids; nothing changes
there. On SQLite both tables are rebuilt in batch mode with every row and id kept (their
ids then continue from the largest stored). The migration runner turns SQLite's foreign keys
off around a migration (service.db.migrate), so dropping the old copy of a table cascades to
no run or result.

Create Date: 2026-12-07 04:00:00
"""

from alembic import op

revision: str = "0021_autoincrement"
down_revision: str | None = "0020_device_used"

TABLES = ("sweep", "run")
"""The tables whose ids a user sees (pages, the CLI, report.md, exports)."""


def _rebuild(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table in TABLES:
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}
        ):
            pass


def upgrade() -> None:
    _rebuild(True)


def downgrade() -> None:
    _rebuild(False)
