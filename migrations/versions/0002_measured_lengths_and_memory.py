"""What the seed tables need: the length each rank measured, memory after the inputs, the
correctness check's length, each rank's peak per probe and the failed allocation's size.

Create Date: 2026-11-24 09:00:00
"""

import sqlalchemy as sa
from alembic import op
from service.migrations.ops import add_columns, drop_columns, of_type

revision: str = "0002"
down_revision: str | None = "0001"

# Rows stored before this revision measured run.seq_len, or for a search its longest fit.
BACKFILL_SEQ_LEN = """
UPDATE rank_result SET seq_len = COALESCE(
    (SELECT MAX(p.seq_len) FROM probe p WHERE p.run_id = rank_result.run_id AND p.outcome = 'fit'),
    (SELECT r.seq_len FROM run r WHERE r.id = rank_result.run_id)
)
"""


def upgrade() -> None:
    add_columns(
        "rank_result",
        batch=True,
        **of_type(sa.BigInteger(), "seq_len", "input_memory_bytes", "check_seq_len"),
    )
    op.execute(BACKFILL_SEQ_LEN)
    with op.batch_alter_table("rank_result") as batch:
        batch.alter_column("seq_len", existing_type=sa.BigInteger(), nullable=False)
    add_columns(
        "probe",
        batch=True,
        input_memory_bytes=sa.BigInteger(),
        rank_peak_bytes=sa.JSON(),
        requested_bytes=sa.BigInteger(),
    )


def downgrade() -> None:
    drop_columns("probe", "requested_bytes", "rank_peak_bytes", "input_memory_bytes", batch=True)
    drop_columns("rank_result", "check_seq_len", "input_memory_bytes", "seq_len", batch=True)
