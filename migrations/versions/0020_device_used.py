"""CUDA ranks' device-wide used bytes beside the allocator's peak: device_used_bytes, what the
device's use grew by from the rank's baseline to the end of its timed iterations (NCCL's
buffers and library workspaces included). CPU ranks, and ranks stored before, read NULL.

Create Date: 2026-12-07 04:30:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0020_device_used"
down_revision: str | None = "0019_compile"

upgrade, downgrade = added_columns("rank_result", device_used_bytes=sa.BigInteger())
