"""What several migrations do alike, said once: nullable columns added to a table and dropped
again, the tables of per-run rows (an id, the run they belong to, indexed by run), and runs of
columns of one type (the type named once, not once a column).

Columns are added in place unless `batch` is true: on SQLite batch mode rebuilds the table, and
dropping the old copy of a table that runs refer to cascades to them (see 0005). Revisions
0002, 0003 and 0006 ran in batch mode and still do: a migration that has run must stay the
same, whatever the database it upgrades.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from alembic import op


def columns(kind: Any, *names: str, nullable: bool = False) -> list[sa.Column[Any]]:
    """The columns `names`, in order, each of type `kind` and the given nullability."""
    return [sa.Column(name, kind, nullable=nullable) for name in names]


def of_type(kind: Any, *names: str) -> dict[str, Any]:
    """`names` mapped to `kind`, in order: add_columns' and added_columns' name=type pairs for a
    run of columns of one type."""
    return dict.fromkeys(names, kind)


class _InPlace:
    """`table`'s ALTERs one by one, outside batch mode (what batch mode's `alter` offers)."""

    def __init__(self, table: str) -> None:
        self.table = table

    def add_column(self, column: sa.Column[Any]) -> None:
        op.add_column(self.table, column)

    def drop_column(self, name: str) -> None:
        op.drop_column(self.table, name)


@contextmanager
def _altering(table: str, batch: bool) -> Iterator[Any]:
    """What alters `table`: batch mode's alter, or ALTERs in place."""
    if not batch:
        yield _InPlace(table)
        return
    with op.batch_alter_table(table) as alter:
        yield alter


def add_columns(table: str, *, batch: bool = False, **columns: Any) -> None:
    """Add `columns` (name=type, each nullable) to `table`, in their order."""
    with _altering(table, batch) as alter:
        for name, kind in columns.items():
            alter.add_column(sa.Column(name, kind, nullable=True))


def drop_columns(table: str, *names: str, batch: bool = False) -> None:
    """Drop the columns `names` of `table`, in that order."""
    with _altering(table, batch) as alter:
        for name in names:
            alter.drop_column(name)


def added_columns(table: str, **columns: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """The upgrade and downgrade of a revision that only adds nullable columns (name=type) to
    `table` in place: the downgrade drops them again, the last added first."""

    def upgrade() -> None:
        add_columns(table, **columns)

    def downgrade() -> None:
        drop_columns(table, *reversed(columns))

    return upgrade, downgrade


def create_run_table(name: str, *items: sa.schema.SchemaItem) -> None:
    """Create table `name` of per-run rows: an integer id, the run (deleted with it), then
    `items` (columns and constraints), and the index ix_<name>_run_id."""
    op.create_table(
        name,
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("run.id", ondelete="CASCADE"), nullable=False
        ),
        *items,
    )
    op.create_index(f"ix_{name}_run_id", name, ["run_id"])


def drop_run_table(name: str) -> None:
    """Drop a table that create_run_table made, and its index."""
    op.drop_index(f"ix_{name}_run_id", table_name=name)
    op.drop_table(name)
