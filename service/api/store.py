"""Database reads and writes behind the sweep endpoints (ORM only; atomic state changes)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Select, delete, exists, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.api import pages
from service.api.deps import MAX_BIGINT, MAX_ID, NO_NUL
from service.api.schemas import SweepOut
from service.db.engine import rowcount
from service.db.models import (
    ACTIVE_STATUSES,
    DEFAULT_SUBMITTER,
    RUN_CONFIG_COLUMNS,
    RUN_RESULT_TABLES,
    TERMINAL_STATUSES,
    Probe,
    Run,
    RunStatus,
    Sweep,
    cell_delta,
    full_config,
    probe_table,
    utcnow,
)
from service.leases import back_to_queue
from service.spec import Cell, SpecError, SweepSpec

CANCELLABLE = (RunStatus.queued, RunStatus.waiting_resources, RunStatus.running)
RETRYABLE = (RunStatus.failed, RunStatus.timed_out)
"""Retried by default. oom is deterministic for a given config and cluster, so it is retried
only when asked (include_oom), e.g. after the cluster changed; cancelled runs likewise.
"""


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before for a different spec."""


def run_counts(session: Session, sweep_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    """Runs per status for each sweep, every status present (zeros included)."""
    counts: dict[int, dict[str, int]] = {sid: dict.fromkeys(RunStatus, 0) for sid in sweep_ids}
    if not sweep_ids:
        return counts
    rows = session.execute(
        select(Run.sweep_id, Run.status, func.count())
        .where(Run.sweep_id.in_(sweep_ids))
        .group_by(Run.sweep_id, Run.status)
    )
    for sweep_id, status, n in rows:
        counts[sweep_id][RunStatus(status)] = n
    return counts


def sweep_out(sweep: Sweep, counts: dict[str, int]) -> SweepOut:
    """The API view of a sweep given its run counts."""
    total = sum(counts.values())
    finished = sum(n for s, n in counts.items() if s in TERMINAL_STATUSES)
    return SweepOut(
        id=sweep.id,
        name=sweep.name,
        kind=str(sweep.kind),
        spec=sweep.spec,
        created_at=sweep.created_at,
        idempotency_key=sweep.idempotency_key,
        submitter=sweep.submitter,
        total=total,
        counts={str(s): n for s, n in counts.items()},
        finished=finished,
        progress=finished / total if total else 1.0,
        done=finished == total,
    )


def load_sweep_out(session: Session, sweep_id: int) -> SweepOut | None:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        return None
    return sweep_out(sweep, run_counts(session, [sweep_id])[sweep_id])


INSERT_CHUNK = 2_000
"""Runs sent per write (COPY on Postgres, an executemany elsewhere): a 100,000-cell sweep never
holds its expansion in memory, and other requests get the interpreter between chunks."""


def _delta(cell: Cell, base: dict[str, Any]) -> dict[str, Any]:
    """What the run stores of its config: the fields whose values differ from base."""
    config = cell.config_json
    if cell.built_over is base:  # every other field is base's own object: diff only these
        return cell_delta(base, {k: config[k] for k in cell.varies})
    return cell_delta(base, config)


def _run_row(sweep_id: int, cell: Cell, base: dict[str, Any], now: Any) -> dict[str, Any]:
    config = cell.config_json
    return {
        "sweep_id": sweep_id,
        "cell_key": cell.cell_key,
        "config": _delta(cell, base),  # the column behind Run.cell_config
        **{name: config[name] for name in RUN_CONFIG_COLUMNS},  # JSON: str, int and bool
        "status": RunStatus.queued,
        "attempts": 0,
        "created_at": now,
    }


RUN_COLUMNS = (
    "sweep_id",
    "cell_key",
    "config",
    *RUN_CONFIG_COLUMNS,
    "status",
    "attempts",
    "created_at",
)
"""The columns a stored run fills, by their names in the table (_run_row, _copy_lines)."""

_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
"""COPY's text format: a backslash, tab, newline or carriage return inside a value escaped."""


def _copy_value(value: Any) -> str:
    """One value in COPY's text format: booleans t/f, numbers as Python writes them, text
    escaped."""
    if value is True or value is False:
        return "t" if value else "f"
    if isinstance(value, int | float):
        return str(value)
    return str(value).translate(_COPY_ESCAPES)


class _CopyLines:
    """Formats runs as COPY's text format (RUN_COLUMNS, tab-separated), each distinct piece
    once: what every run shares (sweep, status, attempts, time), each distinct tuple of the
    run's columns, and, for a cell the memo built over the sweep's base (Cell.built_over),
    each varying field's value as the stored delta shows it (the same JSON bytes that
    json.dumps(_delta(cell, base)) writes)."""

    def __init__(self, sweep_id: int, base: dict[str, Any], now: datetime) -> None:
        self.base = base
        self.head = f"{_copy_value(sweep_id)}\t"
        self.tail = "\t" + "\t".join(_copy_value(v) for v in (RunStatus.queued, 0, now)) + "\n"
        # RunConfig's types are strict (kernel a str, seq_len an int, causal a bool...), so
        # equal tuples of these columns are equal values of the same types.
        self.columns: dict[tuple[Any, ...], str] = {}
        self.pieces: dict[tuple[str, int], tuple[Any, str]] = {}
        """(field, id(value)) -> (value, '"field": value' escaped, or "" when it equals the
        base's); the value is kept, so its id is never another object's."""

    def _piece(self, field: str, value: Any) -> str:
        got = self.pieces.get((field, id(value)))
        if got is not None and got[0] is value:
            return got[1]
        delta = cell_delta(self.base, {field: value})
        piece = json.dumps(delta)[1:-1].translate(_COPY_ESCAPES) if delta else ""
        self.pieces[(field, id(value))] = (value, piece)
        return piece

    def _delta(self, cell: Cell) -> str:
        """The run's stored config (Run.cell_config), escaped."""
        config = cell.config_json
        if cell.built_over is not self.base:
            return json.dumps(_delta(cell, self.base)).translate(_COPY_ESCAPES)
        pieces = [self._piece(k, config[k]) for k in cell.varies]
        return "{" + ", ".join([p for p in pieces if p]) + "}"

    def line(self, cell: Cell) -> str:
        config = cell.config_json
        values = tuple([config[name] for name in RUN_CONFIG_COLUMNS])
        columns = self.columns.get(values)
        if columns is None:
            columns = self.columns[values] = "\t".join([_copy_value(v) for v in values])
        return f"{self.head}{cell.cell_key}\t{self._delta(cell)}\t{columns}{self.tail}"


def _copy_lines(
    sweep_id: int, cells: Iterable[Cell], base: dict[str, Any], now: datetime
) -> Iterator[tuple[str, int]]:
    """The runs of `cells` in COPY's text format (_CopyLines), INSERT_CHUNK lines a piece,
    each with its number of lines: written in one piece, not value by value (psycopg's
    write_row costs more than the line)."""
    line = _CopyLines(sweep_id, base, now).line
    lines: list[str] = []
    for cell in cells:
        lines.append(line(cell))
        if len(lines) == INSERT_CHUNK:
            yield "".join(lines), len(lines)
            lines = []
    if lines:
        yield "".join(lines), len(lines)


def _insert_runs(
    session: Session, sweep_id: int, cells: Iterable[Cell], base: dict[str, Any], now: datetime
) -> int:
    """Insert a run per cell in the session's transaction, INSERT_CHUNK at a time as cells
    come; how many. On Postgres one COPY for the whole sweep (about twice as fast as an
    executemany), its chunks streamed as they are formatted, so the database indexes one
    chunk while the next is expanded; elsewhere a Core executemany a chunk (no ORM
    bookkeeping per row)."""
    stored = 0
    if session.get_bind().dialect.name != "postgresql":
        rows = (_run_row(sweep_id, cell, base, now) for cell in cells)
        while chunk := list(itertools.islice(rows, INSERT_CHUNK)):
            session.execute(insert(Run.__table__), chunk)  # type: ignore[arg-type]
            stored += len(chunk)
        return stored
    driver = session.connection().connection.driver_connection
    assert driver is not None  # for mypy: a live psycopg connection
    columns = ", ".join(RUN_COLUMNS)
    invalid: SpecError | None = None
    with driver.cursor() as cursor, cursor.copy(f"COPY run ({columns}) FROM STDIN") as copy:
        try:
            for text, lines in _copy_lines(sweep_id, cells, base, now):
                copy.write(text)
                stored += lines
        except SpecError as e:  # the COPY ends cleanly: the transaction stays usable
            invalid = e  # (create_sweeps checks the next documents in it, then rolls back)
    if invalid is not None:
        raise invalid
    return stored


def _add_runs(session: Session, sweep: Sweep, cells: Iterable[Cell], now: datetime) -> int:
    """Add `sweep` (flushed at the first cell, whose config becomes its base_config) and a run
    per cell, inserted as cells come; how many runs. Commits nothing."""
    remaining = iter(cells)
    first = next(remaining, None)  # a lazy expansion's structural SpecError comes here
    session.add(sweep)
    if first is None:  # no cells at all
        return 0
    sweep.base_config = base = first.config_json  # read once, not through the ORM a cell
    session.flush()
    return _insert_runs(session, sweep.id, itertools.chain([first], remaining), base, now)


def _new_sweep(spec: SweepSpec, spec_json: dict[str, Any], key: str | None, submitter: str,
               now: datetime) -> Sweep:  # fmt: skip
    return Sweep(
        name=spec.name,
        kind=spec.kind,
        spec=spec_json,
        idempotency_key=key,
        created_at=now,
        submitter=submitter,
    )


def create_sweep(
    session: Session,
    spec: SweepSpec,
    cells: Iterable[Cell],
    idempotency_key: str | None,
    submitter: str = DEFAULT_SUBMITTER,
) -> tuple[Sweep, int, bool]:
    """Store a sweep and its runs in one transaction; (sweep, runs stored, created).

    `cells` may be a lazy expansion (spec.iter_cells): runs are inserted INSERT_CHUNK at a time
    as cells come, and a SpecError raised by the expansion rolls everything back (nothing is
    stored). The first cell's config becomes the sweep's base_config; each run stores what
    differs from it. With an idempotency key already used for the same spec, returns that
    sweep (created=False).
    """
    spec_json = spec.model_dump(mode="json")
    if idempotency_key is not None:
        existing = _by_key(session, idempotency_key, spec_json)
        if existing is not None:
            return existing, 0, False
    now = utcnow()
    sweep = _new_sweep(spec, spec_json, idempotency_key, submitter, now)
    try:
        stored = _add_runs(session, sweep, cells, now)
        session.commit()
    except IntegrityError:
        session.rollback()
        if idempotency_key is None:
            raise
        existing = _by_key(session, idempotency_key, spec_json)
        if existing is None:
            raise
        return existing, 0, False
    except BaseException:
        session.rollback()
        raise
    return sweep, stored, True


@dataclass(frozen=True)
class Document:
    """One document of a multi-document submission: its spec, its lazy expansion, its key."""

    spec: SweepSpec
    cells: Iterable[Cell]
    key: str | None


def create_sweeps(
    session: Session, documents: Sequence[Document], submitter: str = DEFAULT_SUBMITTER
) -> list[tuple[Sweep, int, bool]]:
    """Store every document's sweep and runs in one transaction, or none of them.

    Every document is expanded even after one failed, so that the SpecError raised then lists
    the problems of each (their locs start with ('documents', i)). A document whose key was
    used before for the same spec is that sweep (created False); one used for another spec is
    an IdempotencyConflict. A concurrent submission under the same keys that commits first
    makes this one an IntegrityError (nothing stored)."""
    now = utcnow()
    out: list[tuple[Sweep, int, bool]] = []
    errors: list[dict[str, Any]] = []
    try:
        for i, doc in enumerate(documents):
            spec_json = doc.spec.model_dump(mode="json")
            existing = _by_key(session, doc.key, spec_json) if doc.key is not None else None
            try:
                if existing is not None:
                    out.append((existing, 0, False))
                elif errors:  # nothing will be stored: only this document's problems count
                    for _ in doc.cells:
                        pass
                else:
                    sweep = _new_sweep(doc.spec, spec_json, doc.key, submitter, now)
                    out.append((sweep, _add_runs(session, sweep, doc.cells, now), True))
            except SpecError as e:
                errors += [{**err, "loc": ["documents", i, *err["loc"]]} for err in e.errors]
        if errors:
            raise SpecError(errors)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return out


def sweep_for_key(session: Session, key: str, spec: SweepSpec) -> Sweep | None:
    """The sweep stored under an Idempotency-Key (IdempotencyConflict for another spec)."""
    return _by_key(session, key, spec.model_dump(mode="json"))


def _by_key(session: Session, key: str, spec_json: dict[str, Any]) -> Sweep | None:
    sweep = session.scalars(select(Sweep).where(Sweep.idempotency_key == key)).one_or_none()
    if sweep is not None and sweep.spec != spec_json:
        raise IdempotencyConflict(
            f"Idempotency-Key {key!r} was used for sweep {sweep.id} with a different spec"
        )
    return sweep


def cancel_sweep(session: Session, sweep_id: int) -> int:
    """Queued, waiting and running runs -> cancelled (the scheduler stops running ones)."""
    result = session.execute(
        update(Run)
        .where(Run.sweep_id == sweep_id, Run.status.in_(CANCELLABLE))
        .values(status=RunStatus.cancelled, finished_at=utcnow(), error="cancelled by request")
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return rowcount(result)


def retry_sweep(
    session: Session, sweep_id: int, *, include_oom: bool = False, include_cancelled: bool = False
) -> int:
    """Failed and timed-out runs (and oom/cancelled ones if asked) -> queued, attempts reset.

    Their partial results and probes are removed so the new attempt's numbers stand alone.
    """
    statuses = list(RETRYABLE)
    if include_oom:
        statuses.append(RunStatus.oom)
    if include_cancelled:
        statuses.append(RunStatus.cancelled)
    retry_ids = select(Run.id).where(Run.sweep_id == sweep_id, Run.status.in_(statuses))
    # (artifacts' files stay under the artifact root; the new attempt's replace those of its names)
    for table in RUN_RESULT_TABLES:
        session.execute(delete(table).where(table.run_id.in_(retry_ids)))
    result = session.execute(
        update(Run)
        .where(Run.sweep_id == sweep_id, Run.status.in_(statuses))
        .values(**back_to_queue(None), attempts=0, finished_at=None, environment_id=None)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return rowcount(result)


def delete_sweep(session: Session, sweep_id: int) -> bool:
    """Delete the sweep and (by cascade) its runs unless one is running; True if deleted.

    One conditional statement, so a run claimed concurrently cannot be deleted under the scheduler.
    """
    active = exists().where(Run.sweep_id == sweep_id, Run.status.in_(ACTIVE_STATUSES))
    result = session.execute(
        delete(Sweep)
        .where(Sweep.id == sweep_id, ~active)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return rowcount(result) == 1


@dataclass(frozen=True)
class Page:
    """One page of a list: its rows, how many match in all (exact up to pages.COUNT_CAP) and
    the cursor of the next page (None on the last)."""

    data: list[Any]
    count: int | None
    count_exact: bool
    next: str | None


def list_sweeps(
    session: Session,
    *,
    skip: int,
    limit: int,
    kind: str | None,
    name: str | None,
    cursor: str | None = None,
) -> Page:
    """A page of sweeps, newest first, with their run counts."""
    where = []
    if kind is not None:
        where.append(Sweep.kind == kind)
    if name is not None:
        where.append(Sweep.name.contains(name, autoescape=True))
    query = select(Sweep.id).where(*where)
    statement = pages.page_statement(
        query, sort="-id", column=Sweep.id, id_column=Sweep.id, cursor=cursor, skip=skip,
        limit=limit,
    )  # fmt: skip
    rows, next_cursor = pages.page_of(
        session, pages.counted(statement, query), sort="-id", column=Sweep.id,
        id_column=Sweep.id, limit=limit,
    )  # fmt: skip
    count, exact = pages.count_of(session, rows, query)
    ids = [row.id for row in rows]
    by_id = {s.id: s for s in session.scalars(select(Sweep).where(Sweep.id.in_(ids)))}
    counts = run_counts(session, ids)
    data = [sweep_out(by_id[i], counts[i]) for i in ids if i in by_id]  # one deleted meanwhile
    return Page(data, count, exact, next_cursor)


RUN_SORT_KEYS = {
    "id": Run.id,
    "created_at": Run.created_at,
    "started_at": Run.started_at,
    "finished_at": Run.finished_at,
    "seq_len": Run.seq_len,
    "world_size": Run.world_size,
    "kernel": Run.kernel,
    "status": Run.status,
    "dtype": Run.dtype,
    "attempts": Run.attempts,
}
"""The only columns GET /runs sorts by (`sort=<key>` ascending, `sort=-<key>` descending)."""


class RunFilter(BaseModel):
    """The filters GET /runs accepts, each with its bounds (the route's query parameters are
    these fields); every one is optional."""

    model_config = ConfigDict(frozen=True)

    sweep_id: int | None = Field(None, ge=1, le=MAX_ID)
    kernel: str | None = Field(None, max_length=64, pattern=NO_NUL)
    status: RunStatus | None = None
    world_size: int | None = Field(None, ge=1, le=4096)
    seq_len_min: int | None = Field(None, ge=0, le=MAX_BIGINT)
    seq_len_max: int | None = Field(None, ge=0, le=MAX_BIGINT)
    dtype: Literal["float32", "float16", "bfloat16"] | None = None

    def clauses(self) -> list[Any]:
        where: list[Any] = []
        if self.sweep_id is not None:
            where.append(Run.sweep_id == self.sweep_id)
        if self.kernel is not None:
            where.append(Run.kernel == self.kernel)
        if self.status is not None:
            where.append(Run.status == self.status)
        if self.world_size is not None:
            where.append(Run.world_size == self.world_size)
        if self.seq_len_min is not None:
            where.append(Run.seq_len >= self.seq_len_min)
        if self.seq_len_max is not None:
            where.append(Run.seq_len <= self.seq_len_max)
        if self.dtype is not None:
            where.append(Run.dtype == self.dtype)
        return where


RUN_LIST_COLUMNS = tuple(
    getattr(Run, name)
    for name in (
        "id", "sweep_id", "cell_key", "kernel", "seq_len", "world_size", "dtype", "mode",
        "causal", "status", "attempts", "created_at", "started_at", "finished_at", "error",
        "cell_config",
    )
)  # fmt: skip
"""What a run listing shows (RunOut), with its sweep's base_config: plain columns, no ORM
identity map for a page of rows."""


def page_query(
    filters: RunFilter, sort: str, *, limit: int, cursor: str | None = None, skip: int = 0
) -> Select[Any]:
    """The statement behind a page of GET /runs (the EXPLAIN test reads its plan).

    A deferred join: the page's ids are found first from the run table alone (an index walk
    that skips `skip` entries without reading their rows' configs or joining their sweeps),
    and only those `limit + 1` runs are then read whole and joined to their sweep."""
    column = RUN_SORT_KEYS[sort.removeprefix("-")]
    ids = pages.page_statement(
        select(Run.id).where(*filters.clauses()), sort=sort, column=column, id_column=Run.id,
        cursor=cursor, skip=skip, limit=limit,
    ).subquery()  # fmt: skip
    return (
        select(*RUN_LIST_COLUMNS, Sweep.base_config)
        .join(Sweep, Sweep.id == Run.sweep_id)
        .join(ids, ids.c.id == Run.id)
        .order_by(*pages.order_by(column, Run.id, sort.startswith("-")))
    )


def list_runs(
    session: Session,
    filters: RunFilter,
    *,
    sort: str,
    skip: int,
    limit: int,
    cursor: str | None = None,
    with_count: bool = True,
) -> Page:
    """A page of runs matching `filters`, sorted by a whitelisted key (id breaks ties), as
    plain row dicts; with their capped count unless `with_count` is False (a client paging on
    already has it: the page then costs no count).

    One statement either way: the count rides on the page's rows (pages.counted), so a
    counted page costs one round trip and one indexed count, not two queries."""
    statement = page_query(filters, sort, limit=limit, cursor=cursor, skip=skip)
    matching = select(Run.id).where(*filters.clauses())
    rows, next_cursor = pages.page_of(
        session, pages.counted(statement, matching) if with_count else statement, sort=sort,
        column=RUN_SORT_KEYS[sort.removeprefix("-")], id_column=Run.id, limit=limit,
    )  # fmt: skip
    count, exact = pages.count_of(session, rows, matching) if with_count else (None, False)
    data = []
    for row in rows:
        out = dict(row._mapping)
        out.pop(pages.COUNT_LABEL, None)
        out["config"] = full_config(out.pop("base_config"), out.pop("cell_config"))
        data.append(out)
    return Page(data, count, exact, next_cursor)


@dataclass(frozen=True)
class RunState:
    """What the event stream compares between polls for one run."""

    status: str
    attempts: int
    error: str | None
    probes: int = 0
    """Probes a running search has stored so far (0 for a run that is not running)."""
    last_probe: tuple[int, str] | None = None
    """(seq_len, outcome) of the newest of them."""


def run_states(session: Session, sweep_id: int) -> dict[int, RunState]:
    """run id -> its state for every run of a sweep: one narrow query, and one more for the
    probes of its running runs (a search stores them as they come)."""
    rows = session.execute(
        select(Run.id, Run.status, Run.attempts, Run.error).where(Run.sweep_id == sweep_id)
    )
    states = {rid: RunState(str(status), attempts, error) for rid, status, attempts, error in rows}
    running = (
        select(Run.id).where(Run.sweep_id == sweep_id, Run.status == RunStatus.running)
    ).scalar_subquery()
    found = session.execute(
        select(Probe.run_id, func.count(), func.max(Probe.id))
        .where(Probe.run_id.in_(running))
        .group_by(Probe.run_id)
    ).all()
    if found:
        newest = {
            p.id: (p.seq_len, str(p.outcome))
            for p in session.execute(
                select(Probe.id, probe_table.c.seq_len, probe_table.c.outcome).where(
                    Probe.id.in_([last for _, _, last in found])
                )
            )
        }
        for run_id, n, last in found:
            state = states[run_id]
            states[run_id] = RunState(state.status, state.attempts, state.error, n, newest[last])
    return states
