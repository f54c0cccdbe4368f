"""Indexes that hand a run page its ids in order, from the index alone, for every filter the
listing is read by (GET /api/v1/runs by `skip` as much as by `cursor`).

A page sorts by (column, id). The length indexes (status, seq_len), (dtype, seq_len) and
(kernel, status, world_size, seq_len) lacked the id: Postgres read every skipped row from the
table to break ties (an Incremental Sort; 25 ms at skip 2,000 of one state by length). With the
id appended they answer from the index alone. A sweep's runs in one state (sweep_id, status)
gain the id too, and (kernel, status, world_size, id) is new: that filter, newest first, walked
the primary key backwards and read every row of the table until enough matched (30 ms at skip
1,000 when the matches sit in older ids). Each new index replaces one it extends (same prefix,
so its counts stay index-only), except the last, which is one more on every insert.

Create Date: 2026-11-28 21:00:00
"""

from alembic import op

revision: str = "0017_listing_indexes"
down_revision: str | None = "0016"

REPLACED = {
    "ix_run_status_seq_len": (["status", "seq_len"], "ix_run_status_seq_len_id"),
    "ix_run_dtype_seq_len": (["dtype", "seq_len"], "ix_run_dtype_seq_len_id"),
    "ix_run_kernel_status_world_size_seq_len": (
        ["kernel", "status", "world_size", "seq_len"],
        "ix_run_kernel_status_world_size_seq_len_id",
    ),
    "ix_run_sweep_id_status": (["sweep_id", "status"], "ix_run_sweep_id_status_id"),
}
"""old index: (its columns, the index that replaces it with `id` appended)."""
ADDED = {"ix_run_kernel_status_world_size_id": ["kernel", "status", "world_size", "id"]}


def upgrade() -> None:
    for old, (columns, new) in REPLACED.items():
        op.create_index(new, "run", [*columns, "id"])
        op.drop_index(old, table_name="run")
    for name, columns in ADDED.items():
        op.create_index(name, "run", columns)


def downgrade() -> None:
    for name in ADDED:
        op.drop_index(name, table_name="run")
    for old, (columns, new) in REPLACED.items():
        op.create_index(old, "run", columns)
        op.drop_index(new, table_name="run")
