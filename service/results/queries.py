"""Reads behind every results page and export: a sweep's rows (service.results.rows) with their
baselines, ratios and labels (service.results.baselines).

Two ways in. sweep_rows reads a whole sweep at once (reports, pivots, charts, comparisons).
rows_page reads one page, or a few chosen runs, at a cost that does not grow with the sweep: what
a row needs from the rest of its sweep (what varies, for its label; which runs are its baselines)
depends on configs alone, which never change once stored, so it is found once per sweep and
process by one pass in chunks (SweepContext) and kept.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, joinedload, selectinload

from service.db.models import (
    ArtifactRow,
    Environment,
    MemoryComponentRow,
    Probe,
    RankResultRow,
    RingStep,
    Run,
    RunStatus,
    Sweep,
    full_config,
    ring_step_table,
)
from service.results import baselines
from service.results.rows import RunRow
from service.results.rows_build import rows_of, run_row
from service.spec import AnalysisSpec


def results_for_runs(
    session: Session, run_ids: Sequence[int]
) -> tuple[
    dict[int, list[RankResultRow]], dict[int, list[Probe]], dict[int, list[MemoryComponentRow]]
]:
    """Rank results, probes and memory components of these runs, grouped by run id."""
    ranks: dict[int, list[RankResultRow]] = defaultdict(list)
    probes: dict[int, list[Probe]] = defaultdict(list)
    components: dict[int, list[MemoryComponentRow]] = defaultdict(list)
    if not run_ids:
        return ranks, probes, components
    for rr in session.scalars(
        select(RankResultRow)
        .where(RankResultRow.run_id.in_(run_ids))
        .order_by(RankResultRow.run_id, RankResultRow.rank)
    ):
        ranks[rr.run_id].append(rr)
    for p in session.scalars(select(Probe).where(Probe.run_id.in_(run_ids)).order_by(Probe.id)):
        probes[p.run_id].append(p)
    for c in session.scalars(
        select(MemoryComponentRow)
        .where(MemoryComponentRow.run_id.in_(run_ids))
        .order_by(MemoryComponentRow.run_id, MemoryComponentRow.rank, MemoryComponentRow.id)
    ):
        components[c.run_id].append(c)
    return ranks, probes, components


def load_run(session: Session, run_id: int) -> Run | None:
    """A run with its rank results, probes and environment loaded."""
    return session.scalars(
        select(Run)
        .where(Run.id == run_id)
        .options(
            selectinload(Run.rank_results),
            selectinload(Run.probes),
            joinedload(Run.environment),
        )
    ).one_or_none()


def run_steps(session: Session, run_id: int) -> list[RingStep]:
    """A ring run's steps, by rank, iteration, phase (forward first) and step."""
    step = ring_step_table.c  # its columns generated from workers.results.StepTime
    forward_first = case((step.phase == "forward", 0), else_=1)
    return list(
        session.scalars(
            select(RingStep)
            .where(RingStep.run_id == run_id)
            .order_by(RingStep.rank, step.iteration, forward_first, step.step)
        )
    )


def run_artifacts(session: Session, run_id: int) -> list[ArtifactRow]:
    """A run's artifacts by rank and name."""
    return list(
        session.scalars(
            select(ArtifactRow)
            .where(ArtifactRow.run_id == run_id)
            .order_by(ArtifactRow.rank, ArtifactRow.name)
        )
    )


def run_artifact(session: Session, run_id: int, name: str) -> ArtifactRow | None:
    """One artifact of a run by name."""
    return session.scalars(
        select(ArtifactRow).where(ArtifactRow.run_id == run_id, ArtifactRow.name == name)
    ).one_or_none()


def sweep_runs(session: Session, sweep_id: int) -> list[Run]:
    """Every run of a sweep in id order."""
    return list(session.scalars(select(Run).where(Run.sweep_id == sweep_id).order_by(Run.id)))


def sweep_environments(session: Session, sweep_id: int) -> list[Environment]:
    """The distinct environments the sweep's runs ran on."""
    ids = select(Run.environment_id).where(Run.sweep_id == sweep_id).distinct()
    return list(
        session.scalars(select(Environment).where(Environment.id.in_(ids)).order_by(Environment.id))
    )


def analysis_of(sweep: Sweep) -> AnalysisSpec | None:
    """The sweep's analysis block as submitted (None: the defaults)."""
    block = (sweep.spec or {}).get("analysis")
    return None if block is None else AnalysisSpec.model_validate(block)


LARGE_SWEEP_RUNS = 20_000
"""A whole-sweep read (report, pivot, comparison) of a sweep larger than this holds hundreds of
MiB while it runs: a process runs one such read at a time, and answers another with 429."""
_large_reads = threading.BoundedSemaphore(1)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_memory() -> None:
    """Run after a whole-sweep read has answered (a response's background task): collect the
    cycles its rows left, and hand the freed heap back to the system. Without the trim, glibc
    keeps the pages a 10,000-run report freed (~150 of its ~180 MiB), and the process stays at
    its peak long after."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class WholeSweepBusy(Exception):
    """Another whole-sweep read of a large sweep is running in this process (HTTP 429)."""

    retry_after_s = 10


@contextmanager
def whole_sweep_read(session: Session, *sweep_ids: int) -> Iterator[None]:
    """Admit a handler that reads whole sweeps (sweep_rows) and keeps their rows until it has
    answered: at once for up to LARGE_SWEEP_RUNS runs in all, else only while no other large
    one runs in this process (WholeSweepBusy otherwise)."""
    runs = session.scalar(select(func.count()).where(Run.sweep_id.in_(sweep_ids))) or 0
    if runs <= LARGE_SWEEP_RUNS:
        yield
        return
    if not _large_reads.acquire(blocking=False):
        raise WholeSweepBusy(
            f"a whole-sweep read of another sweep of over {LARGE_SWEEP_RUNS:,} runs is running; "
            f"retry in {WholeSweepBusy.retry_after_s} s (results.csv streams any sweep)"
        )
    try:
        yield
    finally:
        _large_reads.release()


_WITH_SWEEP = selectinload(Run.sweep)
"""Runs read for their rows come with their sweep (one query): its base_config is half of
every run's config, and a lazy load per run costs a quarter of a page's time."""
ROWS_CHUNK = 1_000
"""Runs whose ORM objects (run, ranks, probes, components) sweep_rows holds at once."""


def sweep_rows(session: Session, sweep: Sweep) -> list[RunRow]:
    """Every run of the sweep as a row, in id order, with baselines, ratios and labels. Its
    memory grows with the sweep (the rows; the ORM objects they are read from come and go
    ROWS_CHUNK runs at a time): request handlers call it inside whole_sweep_read."""
    rows: list[RunRow] = []
    envs: dict[int, Environment] = {}
    after = 0
    while True:
        runs = list(
            session.scalars(
                select(Run).where(Run.sweep_id == sweep.id, Run.id > after).order_by(Run.id)
                .limit(ROWS_CHUNK).options(_WITH_SWEEP)
            )
        )  # fmt: skip
        if not runs:
            break
        ranks, probes, components = results_for_runs(session, [r.id for r in runs])
        new_envs = {r.environment_id for r in runs if r.environment_id is not None} - set(envs)
        if new_envs:
            found = session.scalars(select(Environment).where(Environment.id.in_(new_envs)))
            envs.update((e.id, e) for e in found)
        rows += rows_of(runs, ranks, probes, envs, components)
        after = runs[-1].id
    baselines.apply(rows, analysis_of(sweep))
    baselines.set_labels(rows)
    return rows


def one_run(session: Session, run_id: int) -> tuple[Run, RunRow] | None:
    """A run (ranks, probes, environment and sweep loaded) and its row, labelled within its
    sweep and with its baseline; None when there is no such run."""
    run = session.scalars(
        select(Run)
        .where(Run.id == run_id)
        .options(
            selectinload(Run.rank_results),
            selectinload(Run.probes),
            selectinload(Run.environment),
            selectinload(Run.sweep),
        )
    ).first()
    if run is None:
        return None
    (row,) = rows_page(session, run.sweep, run_ids=[run_id])
    return run, row


CONTEXT_CHUNK = 5_000
"""Runs read per query while a sweep's context is found."""
CONTEXTS_KEPT = 16
"""Sweeps whose context a process keeps (least recently used go first)."""


@dataclass(frozen=True)
class SweepContext:
    """What every row of a sweep needs from the others: the params and fields that vary (its
    label shows them) and each run's references (its baseline). Configs alone decide both."""

    vary_params: list[str]
    vary_fields: list[str]
    refs: dict[int, baselines.Refs]


_contexts: OrderedDict[tuple[str, int, datetime], SweepContext] = OrderedDict()
_contexts_lock = threading.Lock()
_context_pass = threading.Lock()


def sweep_context(session: Session, sweep: Sweep) -> SweepContext:
    """The sweep's context, found by one pass over its runs' configs in chunks of
    CONTEXT_CHUNK (no results read), and kept: a sweep's configs never change. Keyed by the
    database, id and creation time, so a deleted sweep whose id is reused is not mistaken for
    the new one."""
    bind = session.get_bind()
    key = (str(bind.engine.url), sweep.id, sweep.created_at)
    with _contexts_lock:
        if key in _contexts:
            _contexts.move_to_end(key)
            return _contexts[key]
    with _context_pass:  # one pass at a time: concurrent first readers wait for it, not redo it
        with _contexts_lock:
            if key in _contexts:
                return _contexts[key]
        return _find_context(session, sweep, key)


@dataclass(frozen=True, slots=True)
class _RunColumns:
    """A run's columns as run_row reads them (rows_build.RunColumns), without the ORM object:
    the context pass reads every run of a sweep, and an ORM object per run costs it a third
    of its time."""

    id: int
    sweep_id: int
    kernel: str
    seq_len: int
    world_size: int
    dtype: str
    causal: bool
    mode: str
    status: RunStatus
    attempts: int
    error: str | None
    environment_id: int | None
    cotenants: list[Any] | None
    config: dict[str, Any]


_CONTEXT_COLUMNS = tuple(f.name for f in fields(_RunColumns) if f.name != "config")


def _find_context(session: Session, sweep: Sweep, key: tuple[str, int, datetime]) -> SweepContext:
    varying = baselines.Varying()
    finder = baselines.ReferenceFinder(analysis_of(sweep))
    base = sweep.base_config
    columns = [getattr(Run, name) for name in _CONTEXT_COLUMNS]
    after = 0
    while True:  # in chunks by id: no more than CONTEXT_CHUNK runs' configs held at once
        chunk = session.execute(
            select(*columns, Run.cell_config)
            .where(Run.sweep_id == sweep.id, Run.id > after)
            .order_by(Run.id)
            .limit(CONTEXT_CHUNK)
        ).all()
        for *values, cell in chunk:
            cells = dict(zip(_CONTEXT_COLUMNS, values, strict=True))
            row = run_row(_RunColumns(**cells, config=full_config(base, cell)), [], [], None, [])
            varying.add(row)
            finder.add(row)
        if len(chunk) < CONTEXT_CHUNK:
            break
        after = chunk[-1][0]
    vary_params, vary_fields = varying.result()
    context = SweepContext(vary_params, vary_fields, finder.refs())
    with _contexts_lock:
        _contexts[key] = context
        while len(_contexts) > CONTEXTS_KEPT:
            _contexts.popitem(last=False)
    return context


def rows_page(
    session: Session,
    sweep: Sweep,
    *,
    after: int = 0,
    limit: int | None = None,
    run_ids: Sequence[int] | None = None,
) -> list[RunRow]:
    """Rows of the sweep's runs with id > `after` in id order (at most `limit`), or of the
    runs `run_ids`: each with its label, baseline and ratios exactly as sweep_rows gives them,
    reading only these runs and their baselines."""
    context = sweep_context(session, sweep)
    chosen = Run.id.in_(run_ids) if run_ids is not None else Run.id > after
    query = (
        select(Run).where(Run.sweep_id == sweep.id, chosen).order_by(Run.id).options(_WITH_SWEEP)
    )
    if limit is not None:
        query = query.limit(limit)
    runs = list(session.scalars(query))
    ids = {r.id for r in runs}
    wanted = set()
    for run in runs:
        ref = context.refs.get(run.id)
        if ref is not None:
            wanted |= {ref.baseline[0]} if ref.baseline else set()
            wanted |= {ref.without_checkpointing} if ref.without_checkpointing else set()
            wanted |= {ref.single_process} if ref.single_process else set()
    others = list(session.scalars(select(Run).where(Run.id.in_(wanted - ids))))
    every = runs + others
    ranks, probes, components = results_for_runs(session, [run.id for run in every])
    env_ids = {run.environment_id for run in every if run.environment_id is not None}
    envs = {
        e.id: e for e in session.scalars(select(Environment).where(Environment.id.in_(env_ids)))
    }
    rows = rows_of(every, ranks, probes, envs, components)
    by_id = {r.run_id: r for r in rows}
    page = rows[: len(runs)]
    baselines.fill(page, by_id, context.refs)
    for r in page:
        r.label = baselines.label(r, context.vary_params, context.vary_fields)
        r.series = baselines.series_label(r, context.vary_params, context.vary_fields)
    return page
