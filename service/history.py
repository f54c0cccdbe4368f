"""One cell's history: every run of the same cell (kernel, shape, params: the compare page's
cell key, service.results.rows.config_key) across all sweeps, ordered by when it ran, with its time,
peak memory and the code version that ran it (GET /api/v1/cells/history and /cells/history).

A cell is named by a run of it (`run`), or by a run config (`cell`: JSON, the defaults filled in
as a submitted sweep's are). Candidates come from the indexed columns every cell key fixes
(kernel, length, world size, dtype, mode, causal); the full key decides.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from service.db.models import Environment, Run
from service.results.queries import results_for_runs
from service.results.rows import config_key
from service.results.rows_build import rows_of
from workers.config import RunConfig

HISTORY_LIMIT = 1000
"""The most recent runs of a cell one answer holds (`truncated` says when there were more)."""


class CellError(ValueError):
    """A cell that cannot be named: `field` is the query parameter, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def config_of_cell(text: str) -> dict[str, Any]:
    """The normalized run config of a `cell` query value (a JSON run config)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CellError("cell", f"not JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(raw, dict):
        raise CellError("cell", "a JSON object (a run config) is needed")
    try:
        config = RunConfig.model_validate(raw).model_dump(mode="json")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CellError("cell", f"{where}: {first['msg']}") from None
    if (too_large := _too_large(config)) is not None:
        raise CellError("cell", f"{too_large}: at most {MAX_INT64:,} (a 64-bit integer)")
    return config


MAX_INT64 = 2**63 - 1
"""The largest integer a stored run's columns hold (seq_len is a BIGINT)."""


def _too_large(value: Any, where: str = "") -> str | None:
    """The path of the first integer in `value` no 64-bit column holds, or None: such a value
    names no stored cell, and the database would refuse to compare with it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return where if abs(value) > MAX_INT64 else None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        if (found := _too_large(item, f"{where}.{key}" if where else str(key))) is not None:
            return found
    return None


def _when(run: Run) -> datetime:
    return run.finished_at or run.started_at or run.created_at


def _code(env: Environment | None) -> dict[str, Any]:
    if env is None:
        return {"git_sha": None, "git_dirty": None, "plugin_code": None}
    return {"git_sha": env.git_sha, "git_dirty": env.git_dirty, "plugin_code": env.plugin_code}


def cell_history(session: Session, config: dict[str, Any]) -> dict[str, Any]:
    """Every run of the cell `config` names, oldest first: sweep, status, time with its
    interval, tokens/s, peak memory and code version."""
    key = config_key(config)
    query = (
        select(Run)
        .where(
            Run.kernel == config["kernel"],
            Run.seq_len == config["seq_len"],
            Run.world_size == config["world_size"],
            Run.dtype == config["dtype"],
            Run.mode == config["mode"],
            Run.causal == config["causal"],
        )
        .options(selectinload(Run.sweep), selectinload(Run.environment))
        .order_by(Run.id.desc())
    )
    runs = [r for r in session.scalars(query) if config_key(r.config) == key]
    truncated = len(runs) > HISTORY_LIMIT
    runs = sorted(runs[:HISTORY_LIMIT], key=lambda r: (_when(r), r.id))
    ranks, probes, components = results_for_runs(session, [r.id for r in runs])
    envs = {e.id: e for e in (r.environment for r in runs) if e is not None}
    rows = rows_of(runs, ranks, probes, envs, components)
    entries = []
    for run, row in zip(runs, rows, strict=True):
        entries.append(
            {
                "run_id": run.id,
                "sweep_id": run.sweep_id,
                "sweep_name": run.sweep.name,
                "status": row.status,
                "at": _when(run),
                "median_s": row.median_s,
                "median_lo_s": row.median_lo_s,
                "median_hi_s": row.median_hi_s,
                "median_ci_level": row.median_ci_level,
                "iterations": row.iterations,
                "tokens_per_s": row.tokens_per_s,
                "peak_memory_bytes": row.peak_memory_bytes,
                "environment_id": run.environment_id,
                **_code(run.environment),
            }
        )
    return {"cell": json.loads(key), "truncated": truncated, "entries": entries}
