"""The write half of the results home: a finished run's outcome (workers.results.RunOutcome)
into its rows, in ONE transaction conditional on the scheduler still holding the run's lease.

The scheduler is the one writer: it maps the outcome (completion_from_outcome), then finish()
writes the terminal status and every result row, or nothing when the lease was lost (a run
cancelled by the API or recovered meanwhile). record_probes() stores a running search's probes
as they come, under the same condition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from service.db import models
from service.db.engine import rowcount
from service.db.models import Run, RunStatus, utcnow
from service.leases import Claim, holding
from workers.results import EnvironmentInfo, ProbeResult, RunOutcome, stored
from workers.results import RankResult as RankMeasure

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.25
MAX_RETRY_S = 4.0

OUTCOME_STATUS = {
    "succeeded": RunStatus.succeeded,
    "failed": RunStatus.failed,
    "oom": RunStatus.oom,
}


@dataclass(frozen=True)
class Completion:
    """What finishing a run writes: its terminal status and its results as the engine declared
    them (workers.results), each stored as the rows of its generated table."""

    status: RunStatus
    error: str | None = None
    ranks: Sequence[RankMeasure] = field(default_factory=tuple)  # with their components, steps
    nodes: Mapping[int, str] = field(default_factory=dict)  # rank -> the node it ran on
    probes: Sequence[ProbeResult] = field(default_factory=tuple)
    environment: EnvironmentInfo | None = None
    artifacts: Sequence[dict[str, Any]] = field(default_factory=tuple)  # artifact rows
    cotenants: Sequence[int] | None = None  # runs that shared its nodes (None: never placed)


def completion_from_outcome(
    outcome: RunOutcome, artifacts: Sequence[dict[str, Any]] = ()
) -> Completion:
    """What finishing a run writes from a workers.results.RunOutcome; `artifacts`: the rows of
    its artifacts, already written (ArtifactStore.write)."""
    status = OUTCOME_STATUS.get(str(outcome.status))
    if status is None:
        raise ValueError(f"outcome.status: unknown status {outcome.status!r}")
    return Completion(
        status=status,
        error=outcome.error,
        ranks=outcome.ranks,
        nodes={p.rank: p.node_ip for p in outcome.placement},  # where each rank ran
        probes=outcome.probes,
        environment=outcome.environment,
        artifacts=artifacts,
    )


def record_probes(sm: sessionmaker[Session], claim: Claim, probes: Sequence[ProbeResult]) -> bool:
    """Store probes of a running search as they come (the dashboard and `ringlab watch` show
    them live), only while the lease holds; False if it no longer does. finish() replaces
    them with the outcome's, which holds them all."""
    with sm() as session, session.begin():
        result = session.execute(
            update(Run)
            .where(holding(claim))
            .values(heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if rowcount(result) != 1:
            session.rollback()
            return False
        for probe in probes:
            session.add(models.Probe(run_id=claim.run_id, **stored(probe)))
    return True


def _environment_id(session: Session, env: EnvironmentInfo) -> int:
    # Insert-if-absent by hash: concurrent schedulers writing the same environment both succeed.
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    key = env.hash()
    row = {"created_at": utcnow(), **stored(env), "hash": key}
    session.execute(
        insert(models.Environment).values(**row).on_conflict_do_nothing(index_elements=["hash"])
    )
    return session.scalars(
        select(models.Environment.id).where(models.Environment.hash == key)
    ).one()


def finish(sm: sessionmaker[Session], claim: Claim, completion: Completion) -> bool:
    """Write the terminal status and all results in ONE transaction, only while the lease holds.

    The conditional UPDATE comes first (it takes the row/write lock); if it matches nothing the
    transaction rolls back and nothing is written. Returns whether the write happened.
    """
    if completion.status not in (
        RunStatus.succeeded,
        RunStatus.failed,
        RunStatus.oom,
        RunStatus.timed_out,
    ):
        raise ValueError(
            f"completion.status: not a status the scheduler ends a run with: {completion.status}"
        )
    with sm() as session, session.begin():
        result = session.execute(
            update(Run)
            .where(holding(claim))
            .values(
                status=completion.status,
                error=completion.error,
                finished_at=utcnow(),
                lease_expires_at=None,
                cotenants=None if completion.cotenants is None else list(completion.cotenants),
            )
            .execution_options(synchronize_session=False)
        )
        if rowcount(result) != 1:
            session.rollback()
            return False
        if completion.environment is not None:
            env_id = _environment_id(session, completion.environment)
            session.execute(
                update(Run)
                .where(Run.id == claim.run_id)
                .values(environment_id=env_id)
                .execution_options(synchronize_session=False)
            )
        _add_results(session, claim.run_id, completion)
        # A retried run's artifacts of the same name were overwritten: one row per name.
        names = [a["name"] for a in completion.artifacts]
        if names:
            session.execute(
                delete(models.ArtifactRow).where(
                    models.ArtifactRow.run_id == claim.run_id, models.ArtifactRow.name.in_(names)
                )
            )
        for artifact in completion.artifacts:
            session.add(models.ArtifactRow(run_id=claim.run_id, **artifact))
        session.flush()
    return True


def finish_retrying(
    sm: sessionmaker[Session],
    claim: Claim,
    completion: Completion,
    *,
    patience_s: float,
    renew: Callable[[], object],
) -> bool:
    """finish(), retried with backoff (0.25 s doubling to 4 s) while the database fails, for
    up to patience_s (the caller gives at least its lease's length); between tries `renew()`
    keeps the lease alive once the database answers again, so recovery never requeues a run
    whose result is on its way. Idempotent: a try whose commit went through but whose answer
    was lost is seen (`_written_by`) and not written twice. Raises the last DBAPIError when
    patience runs out."""
    deadline = time.monotonic() + patience_s
    delay = FIRST_RETRY_S
    while True:
        try:
            if finish(sm, claim, completion):
                return True
            return _written_by(sm, claim, completion.status)
        except DBAPIError as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("run %d: writing its end failed (%s); again in %g s", claim.run_id,
                        str(exc).splitlines()[0][:200], delay)  # fmt: skip
        time.sleep(delay)
        delay = min(2 * delay, MAX_RETRY_S)
        try:
            renew()
        except DBAPIError:  # still down: the next try of the write says so, or raises
            log.info("run %d: lease renewal failed too; retrying the write", claim.run_id)


def _written_by(sm: sessionmaker[Session], claim: Claim, status: RunStatus) -> bool:
    """Whether the run already ended with `status` under this claim's lease (an earlier try
    committed, and only its answer was lost): finish() keeps the lease token it wrote under."""
    with sm() as session:
        row = session.execute(
            select(Run.status, Run.lease_owner).where(Run.id == claim.run_id)
        ).one_or_none()
    return row is not None and row.lease_owner == claim.token and row.status == status


def _add_results(session: Session, run_id: int, completion: Completion) -> None:
    """The rows of every rank (its components and ring steps), and of every probe."""
    for rank in completion.ranks:
        node = completion.nodes.get(rank.rank)
        session.add(models.RankResultRow(run_id=run_id, node=node, **stored(rank)))
        for component in rank.components:
            session.add(
                models.MemoryComponentRow(run_id=run_id, rank=rank.rank, **stored(component))
            )
    # The outcome holds every probe: it replaces those stored live while the search ran.
    session.execute(delete(models.Probe).where(models.Probe.run_id == run_id))
    for probe in completion.probes:
        session.add(models.Probe(run_id=run_id, **stored(probe)))
    steps = [
        {"run_id": run_id, "rank": rank.rank, **stored(step)}
        for rank in completion.ranks
        for step in rank.steps
    ]
    if steps:  # many narrow rows: one executemany
        session.execute(insert(models.RingStep), steps)
