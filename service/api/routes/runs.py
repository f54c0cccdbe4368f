"""/api/v1/runs: filtered, sorted, paginated run listing and one run with everything measured."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status

from service.api import store
from service.api.deps import (
    CURSOR_HELP,
    MAX_BIGINT,
    MAX_ID,
    MAX_SKIP,
    NO_NUL,
    SKIP_HELP,
    RunId,
    SessionDep,
    require_read,
)
from service.api.results import headline
from service.api.schemas import Message, RunDetail, RunList, RunOut
from service.db.models import RunStatus
from service.views import run_row

router = APIRouter(prefix="/runs", tags=["runs"], dependencies=[Depends(require_read)])

RunSort = StrEnum(  # type: ignore[misc]
    "RunSort", {k: k for key in store.RUN_SORT_KEYS for k in (key, f"-{key}")}
)
"""Whitelisted sort keys: a column name, '-' in front for descending."""


@router.get(
    "",
    response_model=RunList,
    responses={401: {"model": Message}, 422: {"description": "Invalid filter."}},
)
def list_runs(
    session: SessionDep,
    sweep_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
    kernel: Annotated[str | None, Query(max_length=64, pattern=NO_NUL)] = None,
    status_: Annotated[RunStatus | None, Query(alias="status")] = None,
    world_size: Annotated[int | None, Query(ge=1, le=4096)] = None,
    seq_len_min: Annotated[int | None, Query(ge=0, le=MAX_BIGINT)] = None,
    seq_len_max: Annotated[int | None, Query(ge=0, le=MAX_BIGINT)] = None,
    dtype: Literal["float32", "float16", "bfloat16"] | None = None,
    sort: Annotated[RunSort, Query(description="Column to sort by; prefix '-' to reverse.")] = (
        RunSort("-id")
    ),
    skip: Annotated[int, Query(ge=0, le=MAX_SKIP, description=SKIP_HELP)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=400, description=CURSOR_HELP)] = None,
) -> Response:
    """Runs matching every given filter, one page at a time, with the count and the next
    page's cursor."""
    filters = store.RunFilter(
        sweep_id=sweep_id,
        kernel=kernel,
        status=status_,
        world_size=world_size,
        seq_len_min=seq_len_min,
        seq_len_max=seq_len_max,
        dtype=dtype,
    )
    found = store.list_runs(
        session, filters, sort=sort.value, skip=skip, limit=limit, cursor=cursor
    )
    page = RunList(
        data=[RunOut.model_validate(r) for r in found.data],
        count=found.count,
        count_exact=found.count_exact,
        next=found.next,
    )
    # Serialized once here (the model above is the validation); FastAPI would validate it again.
    return Response(page.model_dump_json(), media_type="application/json")


@router.get(
    "/{run_id}",
    responses={
        404: {"model": Message, "description": "No run with this id."},
        401: {"model": Message},
    },
)
def get_run(run_id: RunId, session: SessionDep) -> RunDetail:
    """One run: config, state, per-rank results, probes, environment, error and headline."""
    run = store.load_run(session, run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    base = RunOut.model_validate(run).model_dump()
    return RunDetail.model_validate(
        {
            **base,
            "lease_owner": run.lease_owner,
            "heartbeat_at": run.heartbeat_at,
            "rank_results": run.rank_results,
            "probes": run.probes,
            "environment": run.environment,
            "headline": headline(run_row(run, run.rank_results, run.probes, run.environment)),
        },
        from_attributes=True,
    )
