"""The node each rank ran on (its Ray node's IP, from the gang's placement): where a usp run's
Ulysses groups sat (within a node or across nodes) is read from it. Ranks stored before read
NULL.

Create Date: 2026-11-28 18:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0016"
down_revision: str | None = "0015"

upgrade, downgrade = added_columns("rank_result", node=sa.String(255))
