"""The execution plan each rank ran: rank_result.plan ("cpu" or "cuda") for the kernels that
choose a plan by the inputs' device (dilated, block_sparse, ring_dilated, ulysses over one of
them). A run with `plan: auto` and device auto keeps auto in its stored config (its cell is
unchanged); its ranks say which plan ran. Other kernels, and ranks stored before, read NULL.

Create Date: 2026-12-07 05:00:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0022_rank_plan"
down_revision: str | None = "0021_autoincrement"

upgrade, downgrade = added_columns("rank_result", plan=sa.Text())
