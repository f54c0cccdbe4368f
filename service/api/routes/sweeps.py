"""/api/v1/sweeps: submit (idempotent), list, inspect, cancel, retry, delete, exports, events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import (
    APIRouter,
    BackgroundTasks,
    Depends,
    Header,
    HTTPException,
    Query,
    Request,
    Response,
    status,
)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.background import BackgroundTask

from service.api import ray_link, store, submission
from service.api.deps import (
    CURSOR_HELP,
    MAX_SKIP,
    NO_NUL,
    SKIP_HELP,
    SessionDep,
    SettingsDep,
    SweepId,
    require_read,
    require_write,
)
from service.api.events import EVENT_SCHEMA, sweep_events
from service.api.schemas import (
    CompareOut,
    ComparePair,
    Message,
    SweepAction,
    SweepBatch,
    SweepBody,
    SweepCheck,
    SweepDocuments,
    SweepList,
    SweepOut,
)
from service.core.config import RunLimits
from service.db.models import DEFAULT_SUBMITTER, SUBMITTER_PATTERN, RunStatus, Sweep
from service.results import export, queries
from service.results import service as sweep_results
from service.spec import PivotValue, SpecError, SweepSpec, iter_cells, unstorable_values

router = APIRouter(prefix="/sweeps", tags=["sweeps"])
read = [Depends(require_read)]
write = [Depends(require_write)]
Responses = dict[int | str, dict[str, Any]]
NOT_FOUND: Responses = {404: {"model": Message, "description": "No sweep with this id."}}
AUTH: Responses = {401: {"model": Message, "description": "Missing or wrong bearer token."}}


def _sweep_or_404(session: SessionDep, sweep_id: int) -> SweepOut:
    out = store.load_sweep_out(session, sweep_id)
    if out is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} not found")
    return out


def _noted(out: SweepOut, note: str | None) -> SweepOut:
    """The sweep with `waiting` set when it has queued runs that cannot start (note)."""
    if note is None or not out.counts.get(RunStatus.queued):
        return out
    return out.model_copy(update={"waiting": note})


SWEEP_LOCATION = "/api/v1/sweeps/{}"
"""A stored sweep's Location header."""


def _in_body(errors: list[dict[str, Any]]) -> RequestValidationError:
    """A 422 for spec errors, each located under the request body."""
    return RequestValidationError([{**err, "loc": ["body", *err["loc"]]} for err in errors])


def _stored_before(session: SessionDep, response: Response, sweep_id: int) -> SweepOut:
    """The answer to a replayed Idempotency-Key: 200 with the sweep it created."""
    response.status_code = status.HTTP_200_OK
    response.headers["Location"] = SWEEP_LOCATION.format(sweep_id)
    return _sweep_or_404(session, sweep_id)


def _store_sweep(
    session: SessionDep,
    spec: SweepSpec,
    limits: RunLimits,
    idempotency_key: str | None,
    submitter: str,
) -> tuple[Sweep, int, bool]:
    """store.create_sweep over the lazy expansion; an invalid cell is a 422 (nothing stored),
    a key reused for another spec a 409."""
    try:
        # Expanded lazily while inserting, in one transaction rolled back on any invalid cell.
        return store.create_sweep(
            session, spec, iter_cells(spec, limits), idempotency_key, submitter=submitter
        )
    except SpecError as e:
        raise _in_body(e.errors) from e
    except store.IdempotencyConflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    dependencies=write,
    responses={
        200: {
            "model": SweepOut | SweepBatch | SweepCheck,
            "description": "The sweep(s) stored earlier under this key, or a dry run's check.",
        },
        409: {"model": Message, "description": "Idempotency-Key reused for a different spec."},
        413: {"model": Message, "description": "Request body too large."},
        **AUTH,
    },
)
def create_sweep(
    body: SweepBody,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    background: BackgroundTasks,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=200,
            description="The same key returns the sweep it created (200) instead of a new one; "
            "with several documents, document i uses `<key>-<i>`.",
        ),
    ] = None,
    x_ringlab_submitter: Annotated[
        str,
        Header(
            pattern=SUBMITTER_PATTERN,
            description="Who submits (a user or e-mail name, 1-64 of A-Z a-z 0-9 . _ @ + -): "
            "the queue round-robins across submitters, then across each one's sweeps. Self-"
            "declared (there is one API token), not an authenticated identity.",
        ),
    ] = DEFAULT_SUBMITTER,
    dry_run: Annotated[
        bool,
        Query(
            description="Check and expand every document, store nothing: each document's "
            "cell count and problems (200)."
        ),
    ] = False,
) -> SweepOut | SweepBatch | SweepCheck:
    """Validate and expand the spec, then store the sweep and one queued run per cell.

    The body is one spec, or {"documents": [spec, ...]}: every document is validated and all
    are stored in one transaction, or none. An invalid spec answers 422 with the field path of
    every problem (`documents.<i>.` first for a document); nothing is stored then.
    """
    if dry_run:
        response.status_code = status.HTTP_200_OK
        return submission.check(body.root, settings.run_limits())
    sub = _Submission(
        request, session, settings.run_limits(), response, idempotency_key, x_ringlab_submitter
    )
    out: SweepOut | SweepBatch
    if isinstance(body.root, SweepDocuments):
        out = _create_many(body.root, sub)
    else:
        out = _create_one(body.root, sub)
    factory = request.app.state.sessionmaker
    for made in out.sweeps if isinstance(out, SweepBatch) else [out]:
        if made.total > sweep_results.WARM_CONTEXT_RUNS:  # once answered (see warm_context)
            background.add_task(sweep_results.warm_context, factory, made.id)
    return out


@dataclass(frozen=True)
class _Submission:
    """What storing a POST /sweeps body needs besides its spec or documents: the request (for
    the queue's note), the session, the run limits, the response (status, Location), the
    Idempotency-Key and the submitter."""

    request: Request
    session: Session
    limits: RunLimits
    response: Response
    idempotency_key: str | None
    submitter: str


def _create_one(spec: SweepSpec, sub: _Submission) -> SweepOut:
    """One spec stored with its runs (201), the replay of its key (200), or a 422."""
    if bad := unstorable_values(spec.model_dump(exclude_unset=True)):
        raise _in_body(bad)
    key = sub.idempotency_key
    try:
        existing = store.sweep_for_key(sub.session, key, spec) if key else None
    except store.IdempotencyConflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    if existing is not None:  # answered before expanding: a replay costs one lookup
        return _stored_before(sub.session, sub.response, existing.id)
    sweep, stored, created = _store_sweep(sub.session, spec, sub.limits, key, sub.submitter)
    if not created:
        return _stored_before(sub.session, sub.response, sweep.id)
    sub.response.headers["Location"] = SWEEP_LOCATION.format(sweep.id)
    # Just stored, all queued: no need to count them again.
    out = store.sweep_out(sweep, {**dict.fromkeys(RunStatus, 0), RunStatus.queued: stored})
    return _noted(out, ray_link.queue_problem(sub.request))


def _create_many(body: SweepDocuments, sub: _Submission) -> SweepBatch:
    """Every document stored in one transaction (201), the replay of a key (200), or none
    with every document's problems (422)."""
    specs, problems = submission.parse(body)
    if problems:  # every document's problems: the others' expanded too, as a dry run would
        checked = submission.check(body, sub.limits)
        raise _in_body([p for doc in checked.documents for p in doc.problems])
    documents = [
        store.Document(
            spec,
            submission.lazy_cells(spec, sub.limits),
            f"{sub.idempotency_key}-{i}" if sub.idempotency_key else None,
        )
        for i, spec in enumerate(specs)
    ]
    try:
        made = store.create_sweeps(sub.session, documents, sub.submitter)
    except SpecError as e:
        raise _in_body(e.errors) from e
    except store.IdempotencyConflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    if not any(created for _, _, created in made):
        sub.response.status_code = status.HTTP_200_OK
    note = ray_link.queue_problem(sub.request)
    out = []
    for sweep, stored, created in made:
        if created:
            counts: dict[str, int] = {**dict.fromkeys(RunStatus, 0), RunStatus.queued: stored}
            out.append(_noted(store.sweep_out(sweep, counts), note))
        else:
            out.append(_noted(_sweep_or_404(sub.session, sweep.id), note))
    return SweepBatch(sweeps=out)


@router.get("", dependencies=read, responses=AUTH)
def list_sweeps(
    request: Request,
    session: SessionDep,
    skip: Annotated[int, Query(ge=0, le=MAX_SKIP, description=SKIP_HELP)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    kind: Literal["benchmark", "max_seq_len", "correctness"] | None = None,
    name: Annotated[
        str | None,
        Query(max_length=200, pattern=NO_NUL, description="Substring of the name."),
    ] = None,
    cursor: Annotated[str | None, Query(max_length=400, description=CURSOR_HELP)] = None,
) -> SweepList:
    """Sweeps, newest first, with their run counts and progress, a page at a time."""
    page = store.list_sweeps(session, skip=skip, limit=limit, kind=kind, name=name, cursor=cursor)
    note = ray_link.queue_problem(request)
    return SweepList(**{**vars(page), "data": [_noted(s, note) for s in page.data]})


@router.get("/{sweep_id}", dependencies=read, responses={**NOT_FOUND, **AUTH})
def get_sweep(sweep_id: SweepId, request: Request, session: SessionDep) -> SweepOut:
    """One sweep: its spec, runs per state and progress (and why its queued runs wait, when
    the scheduler cannot reach Ray)."""
    return _noted(_sweep_or_404(session, sweep_id), ray_link.queue_problem(request))


@router.post("/{sweep_id}/cancel", dependencies=write, responses={**NOT_FOUND, **AUTH})
def cancel_sweep(sweep_id: SweepId, session: SessionDep) -> SweepAction:
    """Queued, waiting and running runs -> cancelled; the scheduler stops running gangs."""
    _sweep_or_404(session, sweep_id)
    changed = store.cancel_sweep(session, sweep_id)
    return SweepAction(changed=changed, sweep=_sweep_or_404(session, sweep_id))


@router.post("/{sweep_id}/retry", dependencies=write, responses={**NOT_FOUND, **AUTH})
def retry_sweep(
    sweep_id: SweepId,
    session: SessionDep,
    include_oom: Annotated[
        bool, Query(description="Also requeue runs that ran out of memory.")
    ] = False,
    include_cancelled: Annotated[bool, Query(description="Also requeue cancelled runs.")] = False,
) -> SweepAction:
    """Failed and timed-out runs back to queued with attempts reset (their results removed).

    oom is a measured outcome, not an accident, so it is retried only with include_oom=true;
    cancelled runs only with include_cancelled=true (`ringlab retry` sends it unless
    --no-cancelled, so that cancel then retry resumes a sweep).
    """
    _sweep_or_404(session, sweep_id)
    changed = store.retry_sweep(
        session, sweep_id, include_oom=include_oom, include_cancelled=include_cancelled
    )
    return SweepAction(changed=changed, sweep=_sweep_or_404(session, sweep_id))


@router.delete(
    "/{sweep_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    dependencies=write,
    responses={
        409: {"model": Message, "description": "Runs are running: cancel the sweep first."},
        **NOT_FOUND,
        **AUTH,
    },
)
def delete_sweep(sweep_id: SweepId, session: SessionDep) -> Response:
    """Delete the sweep with its runs and results; refused (409) while runs are running."""
    if session.get(Sweep, sweep_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} not found")
    if not store.delete_sweep(session, sweep_id):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"sweep {sweep_id} has running or waiting runs; cancel it first "
            f"(POST /api/v1/sweeps/{sweep_id}/cancel)",
        )
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@contextmanager
def _found() -> Iterator[None]:
    """A sweep the results service did not find answers 404."""
    try:
        yield
    except sweep_results.SweepNotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e


CSV_ROUTE: dict[str, Any] = {
    "dependencies": read,
    "response_model": None,
    "response_class": Response,
    "responses": {
        200: {"content": {"text/csv": {"schema": {"type": "string"}}}},
        **NOT_FOUND,
        **AUTH,
    },
}
"""What every CSV export route declares: read access, a text/csv body, 404 and 401."""


def _attachment(name: str) -> dict[str, str]:
    """The header that saves a response as the file `name`."""
    return {"Content-Disposition": f'attachment; filename="{name}"'}


@router.get(
    "/{sweep_id}/results.json",
    dependencies=read,
    response_model=list[export.ResultRow],  # type: ignore[valid-type]  # generated (export)
    responses={**NOT_FOUND, **AUTH},
)
def results_json(sweep_id: SweepId, session: SessionDep, request: Request) -> Response:
    """One row per run with its numbers and its ratios to its baseline (see report.md),
    streamed a page of runs at a time."""
    with _found():
        sweep_results.sweep_exists(session, sweep_id)
    session.close()  # each page opens its own: no connection held idle for the whole stream
    chunks = sweep_results.results_json_chunks(request.app.state.sessionmaker, sweep_id)
    return StreamingResponse(chunks, media_type="application/json")


@router.get(
    "/{sweep_id}/results.csv",
    **CSV_ROUTE,
)
def results_csv(sweep_id: SweepId, session: SessionDep, request: Request) -> Response:
    """The rows of results.json as CSV with a header line, streamed likewise."""
    with _found():
        sweep_results.sweep_exists(session, sweep_id)
    session.close()
    return StreamingResponse(
        sweep_results.results_csv_chunks(request.app.state.sessionmaker, sweep_id),
        media_type="text/csv",
        headers=_attachment(f"sweep-{sweep_id}.csv"),
    )


@router.get(
    "/{sweep_id}/components.csv",
    **CSV_ROUTE,
)
def components_csv(sweep_id: SweepId, session: SessionDep) -> PlainTextResponse:
    """Model runs' memory per component (limiting rank): predicted, measured, ratio."""
    with _found():
        text = sweep_results.sweep_components_csv(session, sweep_id)
    return PlainTextResponse(
        text,
        media_type="text/csv",
        headers=_attachment(f"sweep-{sweep_id}-components.csv"),
    )


@router.get(
    "/{sweep_id}/pivot.csv",
    **CSV_ROUTE,
)
def pivot_csv(
    sweep_id: SweepId,
    session: SessionDep,
    rows: Annotated[str | None, Query(max_length=100, pattern=NO_NUL)] = None,
    columns: Annotated[list[str] | None, Query(max_length=4)] = None,
    value: Annotated[PivotValue | None, Query()] = None,
) -> PlainTextResponse:
    """One metric as a table: rows x columns (the sweep's baselines.pivot unless overridden)."""
    changes: dict[str, Any] = {}
    if rows is not None:
        changes["rows"] = rows
    if columns:
        changes["columns"] = columns
    if value is not None:
        changes["value"] = value
    try:
        with _found():
            text = sweep_results.sweep_pivot_csv(session, sweep_id, changes)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ["query", *err["loc"]]} for err in e.errors()]
        ) from e
    return PlainTextResponse(text, media_type="text/csv")


@router.get(
    "/{sweep_id}/compare/{other_id}",
    dependencies=read,
    response_model=CompareOut,
    responses={**NOT_FOUND, **AUTH},
)
def compare(sweep_id: SweepId, other_id: SweepId, session: SessionDep) -> StreamingResponse:
    """This sweep (A) and another (B) cell by cell, as the /compare page: B/A with intervals
    from both runs' noise, regressions only beyond both spreads, and whether the two specs
    are identical (names aside). Streamed: its pairs are never all in memory at once."""
    with _found():
        comparison = sweep_results.sweep_comparison(session, sweep_id, other_id)
    return StreamingResponse(
        compare_json_chunks(comparison),
        media_type="application/json",
        # once the answer is sent: the sides are gone, and their memory goes back
        background=BackgroundTask(queries.give_back_memory),
    )


def _json(value: Any) -> str:
    """JSON as FastAPI's JSONResponse writes it (the bytes a CompareOut answer had whole)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


COMPARE_CHUNK_PAIRS = 1_000
"""Pairs per chunk of a streamed comparison."""


def compare_json_chunks(comparison: sweep_results.Comparison) -> Iterator[str]:
    """The comparison's CompareOut JSON in chunks: its head (every field but pairs), then the
    pairs COMPARE_CHUNK_PAIRS at a time, each validated as ComparePair."""
    whole = CompareOut.model_validate({**comparison.head, "pairs": []})
    head = _json(whole.model_dump(mode="json"))
    tail = '"pairs":[]}'
    if not head.endswith(tail):  # pairs must stay CompareOut's last field
        raise RuntimeError(f"CompareOut's JSON does not end with its pairs: {head[-40:]!r}")
    yield head[: -len(tail)] + '"pairs":['
    chunk: list[str] = []
    sep = ""
    for pair in comparison.pairs():
        chunk.append(_json(ComparePair.model_validate(pair).model_dump(mode="json")))
        if len(chunk) == COMPARE_CHUNK_PAIRS:
            yield sep + ",".join(chunk)
            chunk, sep = [], ","
    yield (sep + ",".join(chunk) if chunk else "") + "]}"


@router.get(
    "/{sweep_id}/report.md",
    dependencies=read,
    response_model=None,
    response_class=Response,
    responses={
        200: {"content": {"text/markdown": {"schema": {"type": "string"}}}},
        **NOT_FOUND,
        **AUTH,
    },
)
def report_md(sweep_id: SweepId, session: SessionDep) -> PlainTextResponse:
    """A markdown report: errors, results with ratios, the pivot, maximum lengths, probes,
    environment."""
    with _found():
        text = sweep_results.sweep_report(session, sweep_id)
    # once the answer is sent: the rows are gone, and their memory goes back
    return PlainTextResponse(
        text, media_type="text/markdown", background=BackgroundTask(queries.give_back_memory)
    )


router.add_api_route(
    "/{sweep_id}/events",
    sweep_events,
    methods=["GET"],
    dependencies=read,
    response_model=None,
    response_class=Response,
    responses={
        200: {
            "description": "The events, until `end`.",
            "content": {"text/event-stream": {"schema": EVENT_SCHEMA}},
        },
        429: {"model": Message, "description": "Too many open streams; see Retry-After."},
        **NOT_FOUND,
        **AUTH,
    },
    summary="Server-sent events: run state changes and progress until the sweep is done",
)
