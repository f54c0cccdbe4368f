"""What the seed tables need: the length each rank measured, memory after the inputs, the
correctness check's length, each rank's peak per probe and the failed allocation's size.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rows stored before this revision measured run.seq_len, or for a search its longest fit.
BACKFILL_SEQ_LEN = """
UPDATE rank_result SET seq_len = COALESCE(
    (SELECT MAX(p.seq_len) FROM probe p WHERE p.run_id = rank_result.run_id AND p.outcome = 'fit'),
    (SELECT r.seq_len FROM run r WHERE r.id = rank_result.run_id)
)
"""


def upgrade() -> None:
    with op.batch_alter_table("rank_result") as batch:
        batch.add_column(sa.Column("seq_len", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("input_memory_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("check_seq_len", sa.BigInteger(), nullable=True))
    op.execute(BACKFILL_SEQ_LEN)
    with op.batch_alter_table("rank_result") as batch:
        batch.alter_column("seq_len", existing_type=sa.BigInteger(), nullable=False)
    with op.batch_alter_table("probe") as batch:
        batch.add_column(sa.Column("input_memory_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("rank_peak_bytes", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("requested_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("probe") as batch:
        batch.drop_column("requested_bytes")
        batch.drop_column("rank_peak_bytes")
        batch.drop_column("input_memory_bytes")
    with op.batch_alter_table("rank_result") as batch:
        batch.drop_column("check_seq_len")
        batch.drop_column("input_memory_bytes")
        batch.drop_column("seq_len")
