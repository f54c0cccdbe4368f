"""/api/v1/cells/history: one cell's time, peak memory and code version across every sweep
that ran it (service.history)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query

from service import history
from service.api.deps import MAX_ID, SessionDep, require_read
from service.api.pages import query_error
from service.api.schemas import CellHistoryOut, Message
from service.db.models import Run

router = APIRouter(prefix="/cells", tags=["cells"], dependencies=[Depends(require_read)])

MAX_CELL_CHARS = 20_000
"""A `cell` query value is a run config; no config is longer."""


def cell_config(session: SessionDep, run: int | None, cell: str | None) -> dict[str, Any]:
    """The config naming the cell: run N's, or the `cell` JSON; a 422 naming the parameter
    when neither or both are given or the config is invalid, a 404 for an unknown run."""
    if (run is None) == (cell is None):
        raise query_error("run", "give exactly one of run (a run of the cell) or cell (a config)")
    if run is not None:
        found = session.get(Run, run)
        if found is None:
            raise HTTPException(404, f"no run {run}")
        return found.config
    assert cell is not None
    try:
        return history.config_of_cell(cell)
    except history.CellError as e:
        raise query_error(e.field, str(e)) from None


@router.get(
    "/history",
    response_model=CellHistoryOut,
    responses={401: {"model": Message}, 404: {"model": Message}},
)
def cell_history(
    session: SessionDep,
    run: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="A run of the cell (its config names it).")
    ] = None,
    cell: Annotated[
        str | None,
        Query(max_length=MAX_CELL_CHARS, description="A run config as JSON (defaults filled in)."),
    ] = None,
) -> dict[str, Any]:
    """Every run of one cell (kernel, shape, params) across all sweeps, oldest first, with its
    median time and interval, tokens/s, peak memory and the code version that ran it."""
    return history.cell_history(session, cell_config(session, run, cell))
