"""The torch CPU threads each rank ran with, in its environment: CPU times compare only at equal
counts (a CPU rank holds one Ray CPU and runs one thread). Environments stored before read NULL.

Create Date: 2026-11-27 03:30:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0007"
down_revision: str | None = "0006"

upgrade, downgrade = added_columns("environment", cpu_threads=sa.Integer())
