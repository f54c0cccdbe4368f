"""Each rank result's resident-set peak, beside its allocator peak: the CPU peak meter now counts
the bytes c10's CPU allocator hands out (torch.cuda.max_memory_allocated's meaning), and the
process' RSS high-water mark above the baseline stays as a second, named figure. Results stored
before read NULL (their peak_memory_bytes was the resident figure).

Create Date: 2026-11-27 23:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0009"
down_revision: str | None = "0008"

upgrade, downgrade = added_columns("rank_result", resident_peak_bytes=sa.BigInteger())
