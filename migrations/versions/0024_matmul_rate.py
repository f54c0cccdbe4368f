"""The node's measured matmul rate in a run's environment (workers.matmul_probe): a square GEMM
in the run's dtype on the rank's device, measured once per node: its dtype, side n, best
seconds and 2 n^3 / seconds, what a kernel's FLOP/s is a fraction of. Environments stored
before read NULL.

Create Date: 2026-12-07 15:10:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0024_matmul_rate"
down_revision: str | None = "0023_kept_pairs"

upgrade, downgrade = added_columns(
    "environment",
    matmul_dtype=sa.String(32),
    matmul_size=sa.Integer(),
    matmul_s=sa.Float(),
    matmul_flops_per_s=sa.Float(),
)
