"""The code version of each kernel plugin installed editable from a git checkout (package ->
{git_sha, git_dirty, path}) in a run's environment, beside the project's own git_sha and
git_dirty: a plugin's version string does not change with its code. Environments stored before
read NULL.

Create Date: 2026-11-28 01:10:00
"""

import sqlalchemy as sa
from service.migrations.ops import added_columns

revision: str = "0012"
down_revision: str | None = "0011"

upgrade, downgrade = added_columns("environment", plugin_code=sa.JSON())
