"""Run leases in the database: atomic claims, heartbeats, recovery and the final result write.

Every write after the claim is conditional on still holding the lease (the run's lease token in
`lease_owner` and an active status), so a run cancelled by the API or recovered after a lost
lease is never written by the scheduler that lost it. Each function is one short transaction.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.db.engine import rowcount
from service.db.models import (
    ACTIVE_STATUSES,
    Probe,
    Run,
    RunStatus,
    Sweep,
    full_config,
    utcnow,
)

Kind = Literal["benchmark", "max_seq_len", "correctness"]  # workers.gang.Kind (SweepKind values)


@dataclass(frozen=True)
class Claim:
    """A run this scheduler holds: its id, the lease token and what it needs to start."""

    run_id: int
    token: str
    config: dict[str, Any]
    kind: Kind
    attempts: int


def new_token(owner: str) -> str:
    """A lease token unique to one claim: the owner plus a nonce (fits lease_owner's 128)."""
    return f"{owner[:100]}/{uuid.uuid4().hex[:16]}"


def holding(claim: Claim) -> Any:
    # The one condition every post-claim write carries.
    return (
        (Run.id == claim.run_id)
        & (Run.lease_owner == claim.token)
        & Run.status.in_(ACTIVE_STATUSES)
    )


@dataclass(frozen=True)
class Candidate:
    """The run the queue serves next (not claimed): what the scheduler checks fits first."""

    run_id: int
    config: dict[str, Any]


def _fair_pick() -> Any:
    """SELECT of the queued run the queue serves next: round-robin across submitters, then
    across that submitter's sweeps.

    The submitter served longest ago (the oldest latest claim over all their sweeps; never
    served first, then by their first sweep's id) goes first; among their sweeps with queued
    runs, the one whose last claim is oldest (never claimed first, then by id) gives its lowest
    queued run id. One person's three sweeps and another's one interleave 1:1 by person; FIFO,
    or round-robin by sweep alone, would give the three sweeps three turns to the lone one's.
    """
    queued = select(Run.id).where(Run.sweep_id == Sweep.id, Run.status == RunStatus.queued).exists()
    served = (
        select(
            Sweep.submitter.label("submitter"),
            func.max(Sweep.last_claimed_at).label("last"),
            func.min(Sweep.id).label("first"),
        )
        .group_by(Sweep.submitter)
        .subquery("served")
    )
    sweep_id = (
        select(Sweep.id)
        .join(served, served.c.submitter == Sweep.submitter)
        .where(queued)
        .order_by(
            served.c.last.asc().nulls_first(),
            served.c.first,
            Sweep.last_claimed_at.asc().nulls_first(),
            Sweep.id,
        )
        .limit(1)
        .scalar_subquery()
    )
    return (
        select(Run.id)
        .where(Run.sweep_id == sweep_id, Run.status == RunStatus.queued)
        .order_by(Run.id)
        .limit(1)
    )


def peek_next(sm: sessionmaker[Session]) -> Candidate | None:
    """The run claim_next would take now, without claiming it (None: nothing queued)."""
    with sm() as session:
        run_id = session.scalars(_fair_pick()).first()
        if run_id is None:
            return None
        row = session.execute(
            select(Run.cell_config, Sweep.base_config)
            .join(Sweep, Sweep.id == Run.sweep_id)
            .where(Run.id == run_id)
        ).one()
    return Candidate(run_id, full_config(row.base_config, row.cell_config))


def _claim_values(token: str, now: datetime, lease_s: float) -> dict[str, Any]:
    """The claimed run's new columns: running under `token`'s lease, one attempt more."""
    return {
        "status": RunStatus.running,
        "lease_owner": token,
        "lease_expires_at": now + timedelta(seconds=lease_s),
        "heartbeat_at": now,
        "started_at": now,
        "finished_at": None,
        "error": None,
        "cotenants": None,
        "attempts": Run.attempts + 1,
    }


def _claim_target(session: Session, run_id: int | None) -> Any:
    """What the claiming UPDATE matches: `run_id`; else the fair pick, taken FOR UPDATE SKIP
    LOCKED on Postgres (None when nothing is queued) or as the UPDATE's subquery on SQLite."""
    if run_id is not None:
        return run_id
    if session.get_bind().dialect.name == "postgresql":
        return session.scalars(_fair_pick().with_for_update(skip_locked=True)).first()
    return _fair_pick().scalar_subquery()


def _claimed_row(session: Session, token: str, now: datetime) -> Any:
    """The run `token` claimed (id, sweep, configs, attempts, kind); its earlier attempt's
    probes deleted, its sweep's last claim time set to `now`."""
    row = session.execute(
        select(Run.id, Run.sweep_id, Run.cell_config, Sweep.base_config, Run.attempts)
        .add_columns(Sweep.kind)
        .join(Sweep, Sweep.id == Run.sweep_id)
        .where(Run.lease_owner == token)
    ).one()
    # A new attempt measures afresh: probes an earlier, interrupted attempt stored go.
    session.execute(delete(Probe).where(Probe.run_id == row.id))
    session.execute(
        update(Sweep)
        .where(Sweep.id == row.sweep_id)
        .values(last_claimed_at=now)
        .execution_options(synchronize_session=False)
    )
    return row


def claim_next(
    sm: sessionmaker[Session], owner: str, lease_s: float, run_id: int | None = None
) -> Claim | None:
    """Claim the next queued run in fair order (_fair_pick), or `run_id` if it is still queued
    (status running, lease set, attempts + 1); None if there is none (or `run_id` was taken).

    Postgres: the fair pick takes the row FOR UPDATE SKIP LOCKED, then the UPDATE. SQLite: one
    conditional UPDATE (the pick as its subquery) as the transaction's first statement, so it
    takes the write lock at once. Both re-check status = queued and the rowcount says whether
    this claim won: two schedulers never hold one run. The run's sweep records the claim's time
    (the round-robin's order, by submitter and by sweep).
    """
    token = new_token(owner)
    now = utcnow()
    with sm() as session, session.begin():
        target = _claim_target(session, run_id)
        if target is None:
            return None
        result = session.execute(
            update(Run)
            .where(Run.id == target, Run.status == RunStatus.queued)
            .values(**_claim_values(token, now, lease_s))
            .execution_options(synchronize_session=False)
        )
        if rowcount(result) != 1:
            return None
        row = _claimed_row(session, token, now)
    return Claim(
        run_id=row.id,
        token=token,
        config=full_config(row.base_config, row.cell_config),
        kind=cast(Kind, str(row.kind)),
        attempts=row.attempts,
    )


def heartbeat(
    sm: sessionmaker[Session], claim: Claim, lease_s: float, status: RunStatus | None = None
) -> bool:
    """Renew the lease (and optionally move between running and waiting_resources).

    False means the lease is gone: the API cancelled the run or another scheduler recovered it.
    """
    now = utcnow()
    values: dict[str, Any] = {
        "lease_expires_at": now + timedelta(seconds=lease_s),
        "heartbeat_at": now,
    }
    if status is not None:
        if status not in ACTIVE_STATUSES:
            raise ValueError(f"status: heartbeat moves between active states only, got {status}")
        values["status"] = status
    return update_held(sm, claim, values)


def update_held(sm: sessionmaker[Session], claim: Claim, values: dict[str, Any]) -> bool:
    """Set `values` on the claimed run in one transaction, only while the claim still holds
    its lease (holding); whether it did."""
    with sm() as session, session.begin():
        result = session.execute(
            update(Run)
            .where(holding(claim))
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        return rowcount(result) == 1


DIED_HERE = "requeued: the scheduler running it on this host had died"


def back_to_queue(error: str | None) -> dict[str, Any]:
    """What a run that goes back to the queue gets: no lease, no start, why it went back
    (a requeue here, a retry in service.api.store)."""
    return {
        "status": RunStatus.queued,
        "lease_owner": None,
        "lease_expires_at": None,
        "heartbeat_at": None,
        "started_at": None,
        "error": error,
    }


def requeue(
    sm: sessionmaker[Session], claim: Claim, error: str | None, *, consume_attempt: bool
) -> bool:
    """Give the run back to the queue (a retry, or a graceful stop); False if no longer held.

    A graceful stop does not consume an attempt (attempts goes back down by one).
    """
    values = back_to_queue(error)
    if not consume_attempt:
        values["attempts"] = Run.attempts - 1
    return update_held(sm, claim, values)


def recover_expired(sm: sessionmaker[Session]) -> list[int]:
    """Active runs whose lease expired (their scheduler died) go back to queued; attempts unchanged.

    Returns the ids recovered.
    """
    now = utcnow()
    stale = Run.status.in_(ACTIVE_STATUSES) & or_(
        Run.lease_expires_at.is_(None), Run.lease_expires_at < now
    )
    with sm() as session, session.begin():
        # One UPDATE ... RETURNING (both backends): concurrent recoveries re-check the condition
        # on the locked row, so each run is requeued once.
        ids = session.scalars(
            update(Run)
            .where(stale)
            .values(**back_to_queue("requeued: the lease of the scheduler running it expired"))
            .returning(Run.id)
            .execution_options(synchronize_session=False)
        ).all()
    return sorted(ids)


def owner_process(token: str) -> tuple[str, int, str] | None:
    """(host, pid, instance nonce) of a lease token made from a default owner
    (`host:pid:nonce/claim`); None for an owner given by name."""
    parts = token.partition("/")[0].split(":")
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


def recover_orphans(
    sm: sessionmaker[Session], owner: str, alive: Callable[[int], bool], stale_s: float
) -> list[int]:
    """Active runs held by a dead scheduler on this host go back to queued without waiting
    for their lease to expire; their ids.

    Dead means both: the run's heartbeat is older than `stale_s` (a live scheduler renews it
    every heartbeat), and its lease names this host and a process that is not `alive`, or this
    very process under another instance (a restarted container reuses its pid). The heartbeat
    keeps a live scheduler's runs safe where a pid says too little: several schedulers in one
    process, or containers that share a host name but not their pids. Other leases expire as
    before. The UPDATE re-checks the token it read, so a run claimed again is not touched.
    """
    me = owner_process(owner)
    if me is None:
        return []
    host, pid, nonce = me
    silent_since = utcnow() - timedelta(seconds=stale_s)
    with sm() as session, session.begin():
        held = session.execute(
            select(Run.id, Run.lease_owner).where(
                Run.status.in_(ACTIVE_STATUSES),
                Run.lease_owner.startswith(f"{host}:"),
                or_(Run.heartbeat_at.is_(None), Run.heartbeat_at < silent_since),
            )
        ).all()
        orphans: list[tuple[int, str]] = []
        for run_id, token in held:
            theirs = None if token is None else owner_process(token)
            if token is None or theirs is None or theirs[0] != host:
                continue
            if (theirs[1] == pid and theirs[2] != nonce) or (
                theirs[1] != pid and not alive(theirs[1])
            ):
                orphans.append((run_id, token))
        ids = []
        for run_id, token in orphans:
            result = session.execute(
                update(Run)
                .where(Run.id == run_id, Run.lease_owner == token, Run.status.in_(ACTIVE_STATUSES))
                .values(**back_to_queue("requeued: the scheduler running it on this host had died"))
                .execution_options(synchronize_session=False)
            )
            if rowcount(result) == 1:
                ids.append(run_id)
    return sorted(ids)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 checks, sends nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def requeue_held_by(sm: sessionmaker[Session], owner: str, error: str) -> list[int]:
    """Every active run whose lease `owner` (a scheduler instance) holds goes back to the queue
    with `error`, its attempt not consumed (the scheduler, not the run, was lost); their ids.
    One UPDATE: a run the owner finished meanwhile is no longer active and stays as it is."""
    with sm() as session, session.begin():
        ids = session.scalars(
            update(Run)
            .where(
                Run.status.in_(ACTIVE_STATUSES),
                Run.lease_owner.startswith(f"{owner}/", autoescape=True),
            )
            .values(**back_to_queue(error), attempts=Run.attempts - 1)
            .returning(Run.id)
            .execution_options(synchronize_session=False)
        ).all()
    return sorted(ids)
