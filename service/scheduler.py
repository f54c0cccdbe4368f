"""The scheduler loop: turns queued runs into results on gangs of Ray actors, losing none.

One scheduler drives as many runs at once as the cluster has free resources for, each on its
own gang (placement group) and its own driver thread: claim the next run in fair order
(service.leases: round-robin across submitters, then across their sweeps) once the pool says
it fits, start the gang (workers.gang), poll while renewing the lease by heartbeat, then write
the outcome in one transaction conditional on still holding the lease. A run with
`isolation: node` runs alone. Every run records the runs that shared its nodes
(service.tenancy). Several schedulers may share one Postgres.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from service import leases
from service.artifacts import ArtifactStore
from service.core.config import get_settings
from service.db.models import RunStatus
from service.leases import Claim, Kind
from service.results import write
from service.results.write import Completion, completion_from_outcome
from service.tenancy import Tenancy
from workers import errors
from workers.config import RunConfig
from workers.results import ProbeResult, RunOutcome

log = logging.getLogger(__name__)


class RunHandle(Protocol):
    """A started run (workers.gang.RunHandle)."""

    def poll(self, timeout_s: float) -> RunOutcome | None: ...  # raises RankFailed, ...

    def kill(self, reason: str) -> None: ...

    def placement(self) -> list[Any]: ...  # where the ranks run; empty until the gang is up

    def probes(self) -> list[ProbeResult]: ...  # of a max_seq_len search so far


class Pool(Protocol):
    """Starts runs on (warm or fresh) gangs (workers.gang.GangPool)."""

    def start(
        self, config: RunConfig, kind: Kind, *, on_waiting: Callable[[], None] | None = None
    ) -> RunHandle: ...  # raises workers.errors.Infeasible (checked against the cluster)

    def fits(self, config: RunConfig) -> bool: ...  # free resources hold its gang now


RECOVER_S = 2.0
"""Seconds between recovery passes."""
DEFAULT_HEARTBEAT_S = 5.0
"""How often a scheduler renews the lease of the run it drives."""
MAX_PASS_BACKOFF_S = 30.0
"""Longest wait after a failed scheduling pass (the waits double from poll_s)."""
MAX_LOST_LEASES = 2
"""Claims beyond max_attempts a run gets after its scheduler died under it; then it fails."""
START_WAIT_S = 30.0
"""Longest a claim waits for its run's pool.start before the next claim (which reads fits())."""


@dataclass
class RunTrace:
    """Wall-clock (time.time()) marks of the last run, for bench/scheduler.py."""

    run_id: int
    claim_started_at: float
    claimed_at: float
    outcome: RunOutcome | None = None
    outcome_at: float | None = None  # when poll returned the outcome
    committed_at: float | None = None
    status: RunStatus | None = None


def default_owner() -> str:
    """host:pid:nonce, unique per scheduler instance."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def recover_runs(sm: sessionmaker[Session], owner: str, heartbeat_s: float) -> list[int]:
    """Runs of a dead scheduler return to queued; their ids. Those a scheduler on this host
    held go once their heartbeat is 1.5 periods late (its process is gone, or it was an
    earlier instance of this one); those of other hosts once their lease has expired."""
    orphans = leases.recover_orphans(sm, owner, leases.process_alive, stale_s=1.5 * heartbeat_s)
    if orphans:
        log.warning("requeued %d run(s) of a dead scheduler on this host: %s", len(orphans),
                    orphans)  # fmt: skip
    expired = leases.recover_expired(sm)
    if expired:
        log.warning("requeued %d run(s) with an expired lease: %s", len(expired), expired)
    return sorted(orphans + expired)


def _nodes(placement: Sequence[Any]) -> set[str]:
    """The node ids a gang's ranks run on (workers.results.RankPlacement.node_id)."""
    return {str(getattr(p, "node_id", p)) for p in placement}


def _ended_early(status: RunStatus, error: str, handle: RunHandle) -> Completion:
    """A run that ended without an outcome (timeout, kill, lost rank): its status and error,
    and the probes a max_seq_len search had finished by then, which are measurements too."""
    return Completion(status=status, error=error, probes=handle.probes())


@dataclass
class _Lease:
    """A driven run's lease clock (time.monotonic() seconds) and the status last stored."""

    next_beat: float
    renewed: float
    """The lease is ours until renewed + lease_s."""
    backoff_until: float = 0.0
    """After a failed heartbeat, status moves wait too."""
    shown: RunStatus = RunStatus.running


@dataclass
class _InFlight:
    """A run this scheduler drives on its own thread."""

    claim: Claim
    isolated: bool  # isolation: node (nothing else is claimed while it runs)
    thread: threading.Thread
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once pool.start returned or raised: its placement group is in Ray's table."""


class Scheduler:
    """Claims queued runs while the cluster has room and drives each to a terminal state (or
    back to queued), each on its own thread."""

    def __init__(
        self,
        sessionmaker: sessionmaker[Session],
        *,
        pool: Pool,
        owner: str | None = None,
        lease_s: float = 30.0,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        poll_s: float = 0.5,
        grace_s: float = 10.0,
        recover_s: float = RECOVER_S,
        artifacts: ArtifactStore | None = None,
        max_concurrent: int | None = None,
    ) -> None:
        """lease_s: how long a claim holds without a heartbeat (then recovery requeues the run);
        heartbeat_s: renewal period (also how fast a cancel is noticed); poll_s: poll slice and
        idle wait; grace_s: after a stop, how long the running runs may still finish;
        recover_s: period of the recovery pass, on its own thread (not tied to the lease, and
        not waiting for this scheduler's own runs to end); artifacts: where runs' files go
        (None: the settings' RINGLAB_ARTIFACT_ROOT and caps); max_concurrent: the most runs
        in flight at once (None: as many as pool.fits allows).
        A run's timeout_s counts from its claim (waiting for resources and gang start included).
        """
        if not 0 < heartbeat_s < lease_s:
            raise ValueError(
                f"heartbeat_s: must be > 0 and below lease_s ({lease_s}), got {heartbeat_s}"
            )
        if poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {poll_s}")
        if recover_s <= 0:
            raise ValueError(f"recover_s: must be > 0, got {recover_s}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be >= 1 or None, got {max_concurrent}")
        self.sessionmaker = sessionmaker
        self.pool = pool
        self.owner = owner or default_owner()
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.recover_s = recover_s
        self.max_concurrent = max_concurrent
        self._stopping = threading.Event()
        self._requeue = threading.Event()
        self._inflight: list[_InFlight] = []
        self.tenancy = Tenancy()
        self.last_trace: RunTrace | None = None
        self.traces: dict[int, RunTrace] = {}
        self._trace_lock = threading.Lock()
        if artifacts is None:
            artifacts = ArtifactStore.from_settings(get_settings())
        self.artifacts = artifacts

    # -- control -------------------------------------------------------------------------------

    def stop(self, *, requeue: bool = False) -> None:
        """Stop claiming; running runs finish (or, with requeue, are killed and requeued)."""
        if requeue:
            self._requeue.set()
        self._stopping.set()

    def recover(self) -> list[int]:
        """Runs of dead schedulers back to queued (recover_runs); their ids."""
        return recover_runs(self.sessionmaker, self.owner, self.heartbeat_s)

    def run_forever(self, stop: threading.Event) -> None:
        """Recover, then claim and run until `stop` (or stop()); a stop lets the runs finish
        within grace_s and requeues them after that (attempts unchanged). Recovery passes run
        every recover_s on their own thread meanwhile."""
        self.recover()
        done = threading.Event()
        watcher = threading.Thread(target=self._watch_stop, args=(stop, done), daemon=True)
        recoverer = threading.Thread(target=self._recover_every, args=(done,), daemon=True)
        watcher.start()
        recoverer.start()
        backoff = self.poll_s
        try:
            while not self._stopping.is_set():
                try:
                    started = self.fill()
                except DBAPIError:
                    # The database is down or restarting: keep trying; a run we held and could
                    # not finish is requeued by recovery once its lease expires.
                    log.exception("database error; retrying in %g s", self.lease_s / 4)
                    self._stopping.wait(self.lease_s / 4)
                    continue
                except Exception:  # Ray gone mid-way (fits reads the cluster), or a bug: logged
                    backoff = min(2 * backoff, MAX_PASS_BACKOFF_S)  # and retried, not fatal
                    log.exception("scheduling pass failed; next in %g s", backoff)
                    self._stopping.wait(backoff)
                    continue
                backoff = self.poll_s
                if not started:
                    self._stopping.wait(self.poll_s)
        finally:
            self._stopping.set()
            for flight in list(self._inflight):
                flight.thread.join()
            done.set()
            watcher.join()
            recoverer.join()

    def _recover_every(self, done: threading.Event) -> None:
        while not done.wait(self.recover_s):
            try:
                self.recover()
            except Exception:  # logged; the next pass runs: this thread must outlive a bad pass
                log.exception("recovery pass failed; next in %g s", self.recover_s)

    def _watch_stop(self, stop: threading.Event, done: threading.Event) -> None:
        # Turns the caller's event into a graceful stop: grace_s to finish, then requeue.
        while not done.is_set():
            if stop.wait(0.2):
                self._stopping.set()
                if not done.wait(self.grace_s):
                    self._requeue.set()
                return

    # -- claiming ------------------------------------------------------------------------------

    def in_flight(self) -> list[int]:
        """Ids of the runs this scheduler drives now."""
        self._inflight = [f for f in self._inflight if f.thread.is_alive()]
        return [f.claim.run_id for f in self._inflight]

    def fill(self) -> bool:
        """Claim the next queued run and start driving it on its own thread, if there is room:
        below max_concurrent, no `isolation: node` run in flight, and the pool says its gang
        fits the free resources now (when nothing is in flight it is claimed anyway and waits
        for resources, as waiting_resources). The queue's order is kept: a run that does not
        fit holds back the ones behind it, so a large gang is not starved by small ones.
        True when a run was claimed."""
        if self._stopping.is_set():
            return False
        busy = self.in_flight()
        if busy and (
            any(f.isolated for f in self._inflight)
            or (self.max_concurrent is not None and len(busy) >= self.max_concurrent)
        ):
            return False
        candidate = leases.peek_next(self.sessionmaker)
        if candidate is None:
            return False
        isolated = candidate.config.get("isolation") == "node"
        if busy and (isolated or not self._fits(candidate.config)):
            return False
        claim = self._claim(candidate.run_id)
        if claim is None:
            return True  # taken by another scheduler (or cancelled): look again at once
        flight = _InFlight(claim, isolated, threading.Thread())
        flight.thread = threading.Thread(
            target=self._run_claim,
            args=(claim, flight.started),
            name=f"ringlab-run-{claim.run_id}",
            daemon=True,
        )
        self._inflight.append(flight)
        flight.thread.start()
        # The next fits() must see this gang's placement group, which pool.start creates on the
        # run's thread: without this wait two gangs were claimed into room for one, and the
        # second waited for bundles until its timeout.
        flight.started.wait(START_WAIT_S)
        return True

    def _fits(self, config: dict[str, Any]) -> bool:
        try:
            parsed = RunConfig.model_validate(config)
        except ValueError:
            return True  # claimed and failed at once with the reason (_execute)
        return self.pool.fits(parsed)

    def _claim(self, run_id: int | None) -> Claim | None:
        t0 = time.time()
        claim = leases.claim_next(self.sessionmaker, self.owner, self.lease_s, run_id)
        if claim is None:
            return None
        trace = RunTrace(claim.run_id, claim_started_at=t0, claimed_at=time.time())
        with self._trace_lock:
            self.last_trace = self.traces[claim.run_id] = trace
        self.tenancy.claimed(claim.run_id, t0)
        log.info("claimed run %d (attempt %d)", claim.run_id, claim.attempts)
        return claim

    # -- one run -------------------------------------------------------------------------------

    def run_once(self) -> bool:
        """Claim at most one queued run (the queue's next) and drive it to the end on this
        thread; False when nothing was queued."""
        if self._stopping.is_set():
            return False
        claim = self._claim(None)
        if claim is None:
            return False
        self._run_claim(claim)
        return True

    def _run_claim(self, claim: Claim, started: threading.Event | None = None) -> None:
        started = started or threading.Event()
        try:
            self._execute(claim, started)
        except DBAPIError:  # the lease expires and recovery requeues the run
            log.exception("run %d: database error; its lease will expire", claim.run_id)
        except Exception as exc:  # a bug anywhere below must not wedge the run: fail it loudly
            log.exception("run %d: scheduler error", claim.run_id)
            self._finish(claim, Completion(RunStatus.failed, error=f"scheduler error: {exc!r}"))
        finally:
            started.set()
            self.tenancy.ended(claim.run_id, time.time())  # (gone already if _finish wrote it)
            with self._trace_lock:
                self.traces.pop(claim.run_id, None)  # last_trace keeps the latest claim's

    def _finish(self, claim: Claim, completion: Completion) -> None:
        cotenants = self.tenancy.ended(claim.run_id, time.time())
        completion = dataclasses.replace(completion, cotenants=cotenants)
        # A database blip at the end must not lose an hour-long run: retried for twice the
        # lease, renewing it meanwhile (nothing requeues it while the write waits).
        written = write.finish_retrying(
            self.sessionmaker,
            claim,
            completion,
            patience_s=2 * self.lease_s,
            renew=lambda: leases.heartbeat(self.sessionmaker, claim, self.lease_s),
        )
        trace = self.traces.get(claim.run_id)
        if trace is not None:
            trace.committed_at = time.time()
            trace.status = completion.status
        if not written:
            log.warning(
                "run %d: lease lost (cancelled or recovered); %s not written",
                claim.run_id,
                completion.status,
            )

    def _execute(self, claim: Claim, started: threading.Event) -> None:
        try:
            config = RunConfig.model_validate(claim.config)
        except ValueError as exc:
            self._finish(claim, Completion(RunStatus.failed, error=f"invalid run config: {exc}"))
            return
        lost = claim.attempts - config.max_attempts
        if lost > MAX_LOST_LEASES:
            # Each claim past max_attempts came from a lease that expired under a dead
            # scheduler; a run that keeps killing its scheduler must not loop forever.
            error = (
                f"claimed {claim.attempts} times for max_attempts {config.max_attempts}: the "
                f"scheduler running it died (lease expired) {lost} times; not retried again"
            )
            self._finish(claim, Completion(RunStatus.failed, error=error))
            return
        waiting = threading.Event()
        try:
            # The pool checks feasibility against the cluster before it creates anything and
            # calls on_waiting (from this thread) when the bundles are not ready at once.
            handle = self.pool.start(config, claim.kind, on_waiting=waiting.set)
        except (errors.Infeasible, ValueError) as exc:
            self._finish(claim, Completion(RunStatus.failed, error=str(exc)))
            return
        finally:
            started.set()
        try:
            self._drive(claim, config, handle, waiting)
        except BaseException:
            handle.kill("scheduler error")
            raise

    def _drive(
        self, claim: Claim, config: RunConfig, handle: RunHandle, waiting: threading.Event
    ) -> None:
        """Poll the run until it ends, is cancelled or loses its lease, times out, or the
        scheduler stops; renew the lease by heartbeat (carrying a status move) and store a
        running search's probes as they come."""
        deadline = time.monotonic() + config.timeout_s
        lease = _Lease(next_beat=time.monotonic() + self.heartbeat_s, renewed=time.monotonic())
        stored_probes = 0  # of handle.probes(): a running search's probes are stored as they come
        while True:
            wanted = self._wanted_status(claim, handle, waiting, lease.shown)
            now = time.monotonic()
            if not self._heartbeat(claim, handle, waiting, lease, wanted, now):
                return
            stored_probes = self._store_new_probes(claim, handle, stored_probes)
            if self._stopped_or_late(claim, config.timeout_s, handle, now >= deadline):
                return
            wait = max(0.0, min(self.poll_s, lease.next_beat - now, deadline - now))
            if self._poll_ended(claim, config.max_attempts, handle, wait):
                return

    def _wanted_status(
        self, claim: Claim, handle: RunHandle, waiting: threading.Event, shown: RunStatus
    ) -> RunStatus:
        """waiting_resources while the pool waits for bundles, running once ranks are placed
        (noted in tenancy); else the status shown."""
        placed = self._note_placed(claim, handle)
        if waiting.is_set():
            return RunStatus.running if placed else RunStatus.waiting_resources
        return shown

    def _heartbeat(
        self,
        claim: Claim,
        handle: RunHandle,
        waiting: threading.Event,
        lease: _Lease,
        wanted: RunStatus,
        now: float,
    ) -> bool:
        """Renew the lease when a beat is due or the status moves (moving it to `wanted`);
        False when the run was cancelled or its lease lost (its gang killed). A failed beat is
        retried shortly; one that fails until the lease would expire kills the gang and raises."""
        moved = wanted if wanted != lease.shown else None
        if not ((moved is not None and now >= lease.backoff_until) or now >= lease.next_beat):
            return True
        try:
            held = leases.heartbeat(self.sessionmaker, claim, self.lease_s, moved)
        except DBAPIError:
            if now - lease.renewed >= self.lease_s - self.heartbeat_s:
                handle.kill("lease lost: the database was unreachable")
                raise
            log.warning("run %d: heartbeat failed; retrying", claim.run_id, exc_info=True)
            held = None  # unknown: try again shortly
            lease.next_beat = lease.backoff_until = now + min(1.0, self.heartbeat_s)
        if held is False:
            handle.kill("run cancelled or lease lost")
            log.info("run %d: cancelled or lease lost; gang killed", claim.run_id)
            return False
        if held:
            lease.renewed = now
            lease.next_beat = now + self.heartbeat_s
            lease.shown = wanted
            if lease.shown == RunStatus.running:
                waiting.clear()
        return True

    def _stopped_or_late(
        self, claim: Claim, timeout_s: float, handle: RunHandle, late: bool
    ) -> bool:
        """Requeue the run when the scheduler stops, or end it timed out when `late`; whether
        either did (its gang killed)."""
        if self._requeue.is_set():
            handle.kill("scheduler stopping")
            leases.requeue(
                self.sessionmaker,
                claim,
                "requeued: the scheduler running it stopped",
                consume_attempt=False,
            )
            return True
        if late:
            handle.kill(f"timeout after {timeout_s} s")
            error = f"timed out after {timeout_s:g} s"
            self._finish(claim, _ended_early(RunStatus.timed_out, error, handle))
            return True
        return False

    def _poll_ended(self, claim: Claim, max_attempts: int, handle: RunHandle, wait: float) -> bool:
        """Poll the run for up to `wait` seconds; whether it ended (its end written, or a
        broken gang's run requeued or failed)."""
        try:
            outcome = self._poll(claim, handle, wait)
        except (errors.RankFailed, errors.PlacementTimeout) as exc:
            handle.kill(str(exc))
            self._failed_attempt(claim, max_attempts, str(exc), handle)
            return True
        except errors.GangError as exc:
            handle.kill(str(exc))
            self._finish(claim, _ended_early(RunStatus.failed, str(exc), handle))
            return True
        if outcome is None:
            return False
        self._complete(claim, outcome)
        return True

    def _complete(self, claim: Claim, outcome: RunOutcome) -> None:
        """Write an ended run: its trace's outcome, its artifacts (renewing the lease while an
        upload lasts), then its completion."""
        trace = self.traces.get(claim.run_id)
        if trace is not None:  # (without the artifacts' bytes)
            trace.outcome = outcome.model_copy(update={"artifacts": []})
            trace.outcome_at = time.time()

        def renew() -> None:  # an upload may outlast the lease
            leases.heartbeat(self.sessionmaker, claim, self.lease_s)

        written = self.artifacts.write(claim.run_id, outcome.artifacts, renew)
        self._finish(claim, completion_from_outcome(outcome, written))

    def _poll(self, claim: Claim, handle: RunHandle, wait: float) -> RunOutcome | None:
        """handle.poll, then note where the ranks ran: a run can end within one poll."""
        try:
            return handle.poll(wait)
        finally:
            self._note_placed(claim, handle)

    def _note_placed(self, claim: Claim, handle: RunHandle) -> bool:
        """Record where the run's ranks are once they are (tenancy); whether they are."""
        placed = handle.placement()
        if placed:
            since = getattr(handle, "placed_at", None) or time.time()
            self.tenancy.placed(claim.run_id, _nodes(placed), since)
        return bool(placed)

    def _store_new_probes(self, claim: Claim, handle: RunHandle, stored: int) -> int:
        """Store the probes the search finished since the last call; how many are stored."""
        probes = handle.probes()
        if len(probes) <= stored:
            return stored
        try:
            held = write.record_probes(self.sessionmaker, claim, probes[stored:])
        except DBAPIError:  # the final write stores them all; here they wait for the next try
            log.warning("run %d: storing probes failed; retrying", claim.run_id, exc_info=True)
            return stored
        return len(probes) if held else stored  # a lost lease: the heartbeat acts on it

    def _failed_attempt(
        self, claim: Claim, max_attempts: int, error: str, handle: RunHandle
    ) -> None:
        # A broken gang: retry while attempts remain (the retry searches again), else fail
        # with the cause and the probes that did end.
        msg = f"attempt {claim.attempts}/{max_attempts}: {error}"
        if claim.attempts < max_attempts:
            if leases.requeue(self.sessionmaker, claim, msg, consume_attempt=True):
                log.warning("run %d: %s; requeued", claim.run_id, msg)
            return
        self._finish(claim, _ended_early(RunStatus.failed, msg, handle))
