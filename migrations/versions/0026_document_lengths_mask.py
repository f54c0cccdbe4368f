"""Runs stored with `params.document_lengths` under a kernel whose params take a documents mask
beside it (dense, ring, ulysses) now hold it as `params.mask = {kind: documents, causal: <the
run's causal>, lengths: [...]}` without document_lengths: the one form a sweep stores for either
spelling from this revision (service.spec_mask). History, comparisons, baselines and labels read
the stored config, so an earlier run of a cell matches, compares and shows as a later one.

Each sweep's base_config is rewritten the same way, each run's cell config is its whole config's
difference from the new base, and its cell_key the sha256 of the new config's canonical JSON, as
expansion computes it. A run whose new key another run of its sweep holds (a sweep that spelled
one cell both ways) keeps its config and key: a sweep holds a cell once.

Other kernels keep document_lengths (an adapter such as ring_flash_attn takes no `mask`).
Downgrade leaves the runs as they are: the previous revision reads and runs the mask form too.

Create Date: 2026-12-07 19:00:00
"""

import hashlib
import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0026_document_lengths_mask"
down_revision: str | None = "0025_comm_bytes"

KERNELS = frozenset({"dense", "ring", "ulysses"})
"""The built-in kernels whose params took both document_lengths and a documents mask at this
revision. A plugin kernel whose params take both is converted on submission (service.spec_mask)
but its runs stored before are left as they were: the migration cannot know plugins."""

SWEEP = sa.table("sweep", sa.column("id", sa.Integer), sa.column("base_config", sa.JSON))
RUN = sa.table(
    "run", sa.column("id", sa.Integer), sa.column("sweep_id", sa.Integer),
    sa.column("cell_key", sa.String), sa.column("config", sa.JSON),
)  # fmt: skip


def as_mask(config: dict[str, Any]) -> dict[str, Any]:
    """The whole run config with its document_lengths as the documents mask (the same config
    when it holds none, or its kernel takes no mask)."""
    params = config.get("params")
    causal = config.get("causal")
    if (
        config.get("kernel") not in KERNELS
        or not isinstance(params, dict)
        or params.get("document_lengths") is None
        or params.get("mask") is not None
        or not isinstance(causal, bool)
    ):
        return config
    mask = {"kind": "documents", "causal": causal, "lengths": list(params["document_lengths"])}
    return {**config, "params": {**params, "document_lengths": None, "mask": mask}}


def key_of(config: dict[str, Any]) -> str:
    """The cell key of a whole config: sha256 of its JSON, keys sorted, no whitespace."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _differ(a: Any, b: Any) -> bool:
    """Different as JSON values, as the application's cell delta judges them (1, 1.0 and true
    are three values, where == calls them equal)."""
    return json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True)


def upgrade() -> None:
    conn = op.get_bind()
    for sweep_id, base in conn.execute(sa.select(SWEEP.c.id, SWEEP.c.base_config)).all():
        new_base = as_mask(base) if base else base
        runs = conn.execute(
            sa.select(RUN.c.id, RUN.c.cell_key, RUN.c.config)
            .where(RUN.c.sweep_id == sweep_id)
            .order_by(RUN.c.id)
        ).all()
        taken = {key for _, key, _ in runs}
        for run_id, key, cell in runs:
            whole = {**base, **cell} if base else cell
            new = as_mask(whole)
            new_key = key_of(new) if new is not whole else key
            if new_key != key and new_key in taken:
                new, new_key = whole, key  # the sweep holds this cell already: keep the run
            taken.add(new_key)
            if new is whole and new_base is base:
                continue  # neither its config nor its sweep's base changed
            stored = new  # a sweep stored before 0005: each run holds its whole config
            if base:
                stored = {
                    k: v for k, v in new.items() if k not in new_base or _differ(new_base[k], v)
                }
            conn.execute(
                RUN.update().where(RUN.c.id == run_id).values(config=stored, cell_key=new_key)
            )
        if new_base is not base:
            conn.execute(SWEEP.update().where(SWEEP.c.id == sweep_id).values(base_config=new_base))


def downgrade() -> None:
    """Nothing to undo: the mask form reads and runs the same under the previous revision."""
