"""Compilation counted apart from the measurement: each rank's seconds spent compiling
(torch.compile, Dynamo's own metric) and the graphs it compiled during the run, outside its
timed iterations. Ranks stored before read NULL.

Create Date: 2026-12-07 04:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0019_compile"
down_revision: str | None = "0018_forward_backward"

upgrade, downgrade = added_columns(
    "rank_result", compile_s=sa.Float(), compilations=sa.BigInteger()
)
