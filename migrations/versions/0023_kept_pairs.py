"""The query-key pairs each rank computed: rank_result.kept_pairs (the sharded kernel's own
rank_pairs under the run's mask and balance, summed over the heads, one sequence), so the
imbalance of a run's work (max over mean of its ranks) reads from stored data. Kernels that do
not count pairs per rank, and ranks stored before, read NULL.

Create Date: 2026-12-07 14:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0023_kept_pairs"
down_revision: str | None = "0022_rank_plan"

upgrade, downgrade = added_columns("rank_result", kept_pairs=sa.BigInteger())
