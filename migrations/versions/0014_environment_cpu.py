"""The host CPU's model name and logical CPU count in a run's environment: a CPU time compares
only on the same CPU, at the same thread count (cpu_threads, 0007). Environments stored before
read NULL.

Create Date: 2026-11-28 02:40:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0014"
down_revision: str | None = "0013"

upgrade, downgrade = added_columns("environment", cpu_model=sa.String(256), cpu_cores=sa.Integer())
