"""The correctness gate's sampled check at a run's own length: its error, length and rows,
beside the full check's (max_abs_error, check_seq_len). Results stored before read NULL.

Create Date: 2026-11-27 23:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0008"
down_revision: str | None = "0007"

upgrade, downgrade = added_columns(
    "rank_result",
    sampled_check_error=sa.Float(),
    sampled_check_seq_len=sa.BigInteger(),
    sampled_check_rows=sa.Integer(),
)
