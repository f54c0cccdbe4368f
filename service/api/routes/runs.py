"""/api/v1/runs: filtered, sorted, paginated run listing and one run with everything measured."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from service import artifacts as artifact_files
from service.api import ray_link, store
from service.api.deps import (
    CURSOR_HELP,
    MAX_SKIP,
    SKIP_HELP,
    WITH_COUNT_HELP,
    RunId,
    SessionDep,
    require_read,
)
from service.api.outputs import artifact_out, headline
from service.api.schemas import ArtifactOut, Message, RingStepOut, RunDetail, RunList, RunOut
from service.db.models import Run, RunStatus
from service.results import queries
from service.results.rows_build import run_row

router = APIRouter(prefix="/runs", tags=["runs"], dependencies=[Depends(require_read)])

RunSort = StrEnum(  # type: ignore[misc]
    "RunSort", {k: k for key in store.RUN_SORT_KEYS for k in (key, f"-{key}")}
)
"""Whitelisted sort keys: a column name, '-' in front for descending."""


def _noted(run: RunOut, note: str | None) -> RunOut:
    """The run with `waiting` set when it is queued and cannot start (note)."""
    if note is None or run.status != RunStatus.queued:
        return run
    return run.model_copy(update={"waiting": note})


@router.get(
    "",
    response_model=RunList,
    responses={401: {"model": Message}, 422: {"description": "Invalid filter."}},
)
def list_runs(
    request: Request,
    session: SessionDep,
    filters: Annotated[store.RunFilter, Query()],
    sort: Annotated[RunSort, Query(description="Column to sort by; prefix '-' to reverse.")] = (
        RunSort("-id")
    ),
    skip: Annotated[int, Query(ge=0, le=MAX_SKIP, description=SKIP_HELP)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=400, description=CURSOR_HELP)] = None,
    count: Annotated[bool, Query(description=WITH_COUNT_HELP)] = True,
) -> Response:
    """Runs matching every given filter, one page at a time, with the count and the next
    page's cursor."""
    found = store.list_runs(
        session, filters, sort=sort.value, skip=skip, limit=limit, cursor=cursor, with_count=count
    )
    note = ray_link.queue_problem(request)
    page = RunList(
        data=[_noted(RunOut.model_validate(r), note) for r in found.data],
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
def get_run(run_id: RunId, request: Request, session: SessionDep) -> RunDetail:
    """One run: config, state, per-rank results, probes, environment, error and headline
    (and, queued, why it cannot start when the scheduler cannot reach Ray)."""
    run = queries.load_run(session, run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    base = _noted(RunOut.model_validate(run), ray_link.queue_problem(request)).model_dump()
    return RunDetail.model_validate(
        {
            **base,
            "lease_owner": run.lease_owner,
            "heartbeat_at": run.heartbeat_at,
            "cotenants": run.cotenants,
            "rank_results": run.rank_results,
            "probes": run.probes,
            "environment": run.environment,
            "headline": headline(run_row(run, run.rank_results, run.probes, run.environment)),
        },
        from_attributes=True,
    )


ARTIFACT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
MEDIA_TYPES = {"chrome_trace": "application/json", "memory_snapshot": "application/octet-stream"}


def _run_or_404(session: SessionDep, run_id: int) -> None:
    if session.get(Run, run_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")


@router.get("/{run_id}/steps", responses={404: {"model": Message}, 401: {"model": Message}})
def get_run_steps(run_id: RunId, session: SessionDep) -> list[RingStepOut]:
    """A ring run's every step on every rank in every timed iteration: compute, time blocked
    on a transfer and bytes moved (empty for kernels without a ring)."""
    _run_or_404(session, run_id)
    return [RingStepOut.model_validate(s) for s in queries.run_steps(session, run_id)]


@router.get("/{run_id}/artifacts", responses={404: {"model": Message}, 401: {"model": Message}})
def list_artifacts(run_id: RunId, session: SessionDep) -> list[ArtifactOut]:
    """The run's artifacts: profiler traces (`profile: true`), memory snapshots of an OOM."""
    _run_or_404(session, run_id)
    return [artifact_out(a) for a in queries.run_artifacts(session, run_id)]


@router.get(
    "/{run_id}/artifacts/{name}",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/json": {}, "application/octet-stream": {}}},
        404: {"model": Message, "description": "No such run or artifact, or its file is gone."},
        401: {"model": Message},
    },
)
def download_artifact(
    run_id: RunId,
    session: SessionDep,
    name: Annotated[str, Path(max_length=200, pattern=ARTIFACT_NAME)],
) -> StreamingResponse:
    """The artifact's bytes (a Chrome trace opens in Perfetto or chrome://tracing)."""
    _run_or_404(session, run_id)
    artifact = queries.run_artifact(session, run_id, name)
    if artifact is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} has no artifact {name!r}")
    if artifact.location is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"artifact {name!r} of run {run_id} was not kept: {artifact.refused}",
        )
    if not artifact_files.exists(artifact.location):
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"artifact {name!r} of run {run_id} is recorded at {artifact.location}, but the "
            "file is not there (the artifact root was moved or cleaned)",
        )
    return StreamingResponse(
        artifact_files.read_chunks(artifact.location),
        media_type=MEDIA_TYPES.get(artifact.kind, "application/octet-stream"),
        headers={"Content-Disposition": f'attachment; filename="run-{run_id}-{name}"'},
    )
