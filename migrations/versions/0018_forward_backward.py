"""Forward and backward apart for kernel cells in train mode: each rank's forward and backward
times of every timed iteration, their spreads (p10, p90; the medians forward_s and backward_s
exist since model runs stored them) and the kernel's forward FLOPs. Ranks stored before read
NULL.

Create Date: 2026-11-28 21:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns, of_type

revision: str = "0018_forward_backward"
down_revision: str | None = "0017_listing_indexes"

upgrade, downgrade = added_columns(
    "rank_result",
    **of_type(sa.Float(), "forward_p10_s", "forward_p90_s", "backward_p10_s", "backward_p90_s"),
    **of_type(sa.JSON(), "forward_times_s", "backward_times_s"),
    **of_type(sa.Float(), "forward_flops"),
)
