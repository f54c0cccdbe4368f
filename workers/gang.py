"""Gangs of rank actors: placement group, ordered ranks, process group; a pool that reuses them.

Several runs may be in flight at once, each on its own gang (`GangPool.fits` says whether the
next one's bundles are free now). `GangPool.start(config, kind)` returns a RunHandle at once;
the run goes on in a driver thread that only makes Ray calls, and the scheduler loops on
`handle.poll(timeout_s)` while it heartbeats. A rank that dies fails the run with RankFailed
and the gang is torn down; a warm gang is reused by the next run with the same world size,
resources, placement and NCCL env.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers import kernels, references, search
from workers.actor import RankActor
from workers.cluster import (
    GANG_GROUP_PREFIX,
    DeviceKind,
    bundle,
    check_feasible,
    describe,
    device_kind,
)
from workers.config import RunConfig
from workers.errors import ActorsNotStarted, GangError, PlacementTimeout, RankFailed
from workers.ray_reason import RayletErrors, actor_states, group_nodes
from workers.results import (
    CaseOutcome,
    ProbeResult,
    RankPlacement,
    RunOutcome,
    outcome_of,
)

Kind = Literal["benchmark", "max_seq_len", "correctness"]
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}
READY_AT_ONCE_S = 0.5  # bundles ready within this are "at once": no waiting_resources
FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get before the gang is killed
WAIT_SLICE_S = 0.5  # the run thread's wait granularity (how fast it notices a kill)
ALIVE_TIMEOUT_S = 10.0  # a warm gang's ranks must answer a ping within this to be reused
ACTOR_START_S = 10.0
"""Rank actors not up this long after their bundles were placed: if the raylets of their nodes
logged errors since, those are why (a worker that cannot start leaves its actor pending and
raises nothing), and the start fails with them."""
ACTOR_START_LIMIT_S = 180.0
"""Rank actors not up by then fail the start even without a reason from Ray (a loaded host
takes tens of seconds to start Python workers; the run's own timeout_s still applies)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GangKey:
    """What makes a gang reusable for a run: world size, resources, placement, NCCL env, timeout."""

    world_size: int
    device: DeviceKind
    placement: str
    env: tuple[tuple[str, str], ...]
    dist_timeout_s: float

    @classmethod
    def of(cls, config: RunConfig, device: DeviceKind) -> GangKey:
        """The key of the gang `config` runs on."""
        return cls(
            world_size=config.world_size,
            device=device,
            placement=config.placement,
            env=tuple(sorted(config.env.items())),
            dist_timeout_s=config.dist_timeout_s,
        )


class Gang:
    """W rank actors in one placement group, in rank order, joined in one process group."""

    def __init__(self, key: GangKey) -> None:
        self.key = key
        self.pg: PlacementGroup = placement_group(
            [bundle(key.device)] * key.world_size,
            strategy=STRATEGIES[key.placement],
            name=f"{GANG_GROUP_PREFIX}{uuid.uuid4().hex[:12]}",
        )
        self.actors: list[Any] = []
        self.placement: list[RankPlacement] = []
        self.removed = False
        self.idle_since = time.monotonic()
        """When it last went back to the pool idle (GangPool._release)."""
        self._lock = threading.Lock()

    def ready_ref(self) -> Any:
        """An ObjectRef that resolves when every bundle is reserved."""
        return self.pg.ready()

    def waiting(self) -> bool:
        """Whether its placement group still waits for bundles (PENDING or RESCHEDULING)."""
        return placement_group_table(self.pg).get("state") in ("PENDING", "RESCHEDULING")

    def alive(self, timeout_s: float = ALIVE_TIMEOUT_S) -> bool:
        """Whether every rank actor still answers: a warm gang's process can die while idle
        (OOM killer, a lost node), and a run must not spend an attempt on a dead gang."""
        if len(self.actors) != self.key.world_size:
            return False
        try:
            ray.get([actor.ping.remote() for actor in self.actors], timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False  # the caller discards the gang and starts a new one
        return True

    def spawn(self) -> None:
        """Create one actor per bundle, order ranks by node then GPU id, init the process group."""
        env = dict(self.key.env)
        gpu = self.key.device == "cuda"
        remote = ray.remote(RankActor)
        actors = []
        for index in range(self.key.world_size):
            options: dict[str, Any] = {
                "num_cpus": 0 if gpu else 1,
                "num_gpus": 1 if gpu else 0,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=index
                ),
            }
            if env:
                options["runtime_env"] = {"env_vars": env}
            actors.append(remote.options(**options).remote())
        with self._lock:
            if self.removed:
                for actor in actors:
                    ray.kill(actor, no_restart=True)
                raise GangError("gang removed while it was starting")
            self.actors = actors
        infos = _get_all(actors, [a.info.remote() for a in actors], _start_watch(self.pg, actors))
        order = sorted(
            range(len(actors)),
            key=lambda i: (
                infos[i]["node_ip"],
                infos[i]["node_id"],
                [int(g) if g.isdigit() else g for g in infos[i]["gpu_ids"]],
                i,
            ),
        )
        with self._lock:
            self.actors = [actors[i] for i in order]
        self.placement = [RankPlacement(rank=r, **infos[i]) for r, i in enumerate(order)]
        world = self.key.world_size
        timeout = self.key.dist_timeout_s
        addr = self.placement[0].node_ip
        port = _get_all(self.actors[:1], [self.actors[0].open_store.remote(world, timeout)])[0]
        backend = "nccl" if gpu else "gloo"
        refs = [
            actor.init_dist.remote(rank, world, addr, port, backend, timeout)
            for rank, actor in enumerate(self.actors)
        ]
        _get_all(self.actors, refs)

    def kill_actors(self) -> None:
        """Kill every actor (the placement group stays reserved for fresh ones)."""
        with self._lock:
            actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def remove(self) -> None:
        """Kill every actor and remove the placement group; idempotent."""
        with self._lock:
            if self.removed:
                return
            self.removed = True
        self.kill_actors()
        remove_placement_group(self.pg)


def _cause(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:3])}"[:2000]


def _start_watch(pg: PlacementGroup, actors: list[Any]) -> Callable[[], None]:
    """A check called while the rank actors start: raises ActorsNotStarted with the raylets'
    errors once ACTOR_START_S have passed and their nodes reported any, or without a reason
    from Ray at ACTOR_START_LIMIT_S."""
    started = time.monotonic()
    errors = RayletErrors(group_nodes(pg))

    def check() -> None:
        elapsed = time.monotonic() - started
        if elapsed < ACTOR_START_S:
            return
        reason = errors.reason()
        if reason is None and elapsed < ACTOR_START_LIMIT_S:
            return
        states = ", ".join(actor_states(actors))
        raise ActorsNotStarted(
            f"the actors of {len(actors)} rank(s) did not start within {elapsed:.0f} s "
            f"(actor states: {states}): {reason or 'Ray reported no error on their nodes'}"
        )

    return check


def _get_all(
    actors: list[Any], refs: list[Any], check: Callable[[], None] | None = None
) -> list[Any]:
    """Every ref's value in order; a dead actor raises RankFailed naming its rank (list index).
    `check` is called every WAIT_SLICE_S while refs are pending (it raises to give up)."""
    values: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=WAIT_SLICE_S)
        if not done and check is not None:
            check()
        for ref in done:
            index = refs.index(ref)
            try:
                values[index] = ray.get(ref)
            except RayError as exc:  # the actor died, or raised while joining the gang
                raise RankFailed(index, _cause(exc)) from exc
    return values


def fresh_processes(config: RunConfig, kind: Kind) -> bool:
    """Whether the run takes a new gang and drops it after (config.fresh_processes, or a
    max_seq_len search's own fresh_processes) instead of a warm one it gives back."""
    return config.fresh_processes or bool(
        kind == "max_seq_len" and config.search and config.search.fresh_processes
    )


class RunHandle:
    """One run in flight on a gang: poll it for the outcome, kill it to cancel or time out."""

    def __init__(
        self,
        pool: GangPool,
        gang: Gang,
        config: RunConfig,
        kind: Kind,
        *,
        cold: bool,
    ) -> None:
        self._started = time.monotonic()
        self._timeout_s = pool.placement_timeout_s
        """The placement deadline: _timeout_s from _started (the pool's, fixed at the start)."""
        self.config = config
        self.kind = kind
        self._pool = pool
        self._gang = gang
        self._cold = cold
        self._fresh = fresh_processes(config, kind)
        self._killed: str | None = None
        self._finished = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._outcome: RunOutcome | None = None
        self._error: BaseException | None = None
        self._probes: list[ProbeResult] = []
        self.placed_at: float | None = None if cold else time.time()
        """Wall-clock time the ranks were up (a warm gang's: the start); None until then."""
        self._thread = threading.Thread(target=self._main, name="ringlab-run", daemon=True)

    # public API ---------------------------------------------------------------------------

    def poll(self, timeout_s: float) -> RunOutcome | None:
        """The outcome once the run ended, else None after waiting up to timeout_s.

        Raises RankFailed (a rank died or could not join; the gang is torn down),
        PlacementTimeout (bundles not ready by the deadline) or GangError (the run was killed).
        Any other error of the run comes back as status `failed` with the error.
        """
        if not self._done.wait(max(0.0, timeout_s)):
            return None
        if self._killed is not None:
            raise GangError(f"run was killed: {self._killed}")
        if self._error is not None:
            raise self._error
        if self._outcome is None:
            raise GangError("the run thread ended without an outcome")
        return self._outcome

    def kill(self, reason: str) -> None:
        """Kill the run's actors and remove its placement group (cancel, timeout); idempotent.

        A run that already ended is left alone (its gang went back to the pool or was removed).
        """
        with self._lock:
            if self._finished and self._killed is None:
                return
            if self._killed is None:
                self._killed = reason
        self._pool._discard(self._gang)
        self._done.set()

    def probes(self) -> list[ProbeResult]:
        """The max_seq_len probes that have ended so far (all of them once the run ended)."""
        return list(self._probes)

    def placement(self) -> list[RankPlacement]:
        """Where each rank runs (node, pid, GPUs) once the gang is up; empty before."""
        return list(self._gang.placement)

    # the run thread -----------------------------------------------------------------------

    def _main(self) -> None:
        healthy = False
        try:
            gang_start_s = None
            if self._cold:
                self._wait_ready()
                self._gang.spawn()
                self.placed_at = time.time()
                gang_start_s = time.monotonic() - self._started
            if self.kind == "max_seq_len":
                outcome = search.run_search(self.config, self._run_probe, self._probes)
            else:
                outcome = self._run_case(self.config, self.kind)
            outcome = outcome.model_copy(
                update={"gang_start_s": gang_start_s, "placement": list(self._gang.placement)}
            )
            healthy = len(self._gang.actors) == self.config.world_size
            self._outcome = outcome
        except GangError as exc:  # raised by poll(); the gang is torn down below
            self._error = exc
        except Exception as exc:  # not the gang's fault (e.g. a search config no kernel fits)
            self._outcome = RunOutcome(status="failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._finished = True
                killed = self._killed is not None
            if not killed:
                if healthy and not self._fresh:
                    self._pool._release(self._gang)
                else:
                    self._pool._discard(self._gang)
            self._done.set()

    def _wait_ready(self) -> None:
        ref = self._gang.ready_ref()
        while True:
            self._check_killed()
            remaining = self._started + self._timeout_s - time.monotonic()
            if remaining <= 0:
                raise PlacementTimeout(
                    f"the {self.config.world_size} bundles of {bundle(self._gang.key.device)} "
                    f"(placement={self.config.placement}) were not ready within "
                    f"{self._timeout_s:g} s; free now: {_free_summary()}"
                )
            done, _ = ray.wait([ref], timeout=min(WAIT_SLICE_S, remaining))
            if done:
                return

    def _check_killed(self) -> None:
        if self._killed is not None:
            raise GangError(f"run was killed: {self._killed}")

    def _ensure_actors(self, fresh: bool) -> None:
        if fresh and self._gang.actors:
            self._gang.kill_actors()
        if not self._gang.actors:
            self._check_killed()
            self._gang.spawn()

    def _run_probe(self, config: RunConfig, first: bool) -> list[CaseOutcome]:
        fresh = bool(config.search and config.search.fresh_processes) and not first
        self._ensure_actors(fresh)
        return self._collect(config, "benchmark")

    def _run_case(self, config: RunConfig, kind: Kind) -> RunOutcome:
        cases = self._collect(config, kind)
        return outcome_of(cases, config.world_size)

    def _where(self, rank: int) -> str:
        placed = self._gang.placement
        if rank >= len(placed):
            return ""
        return f"process {placed[rank].pid} on node {placed[rank].node_ip}: "

    def _collect(self, config: RunConfig, kind: str) -> list[CaseOutcome]:
        """Run one case on every rank; a rank's failure gives the others a grace period."""
        actors = list(self._gang.actors)
        payload = config.model_dump_json()
        refs = [actor.run_case.remote(payload, kind) for actor in actors]
        cases: dict[int, CaseOutcome] = {}
        pending = list(refs)
        grace_until: float | None = None
        while pending:
            self._check_killed()
            slice_s = WAIT_SLICE_S
            if grace_until is not None:
                slice_s = min(slice_s, max(0.0, grace_until - time.monotonic()))
            done, pending = ray.wait(pending, num_returns=1, timeout=slice_s)
            for ref in done:
                rank = refs.index(ref)
                try:
                    cases[rank] = ray.get(ref)
                except RayError as exc:  # the actor died (its own errors come back as cases)
                    self._check_killed()
                    raise RankFailed(rank, self._where(rank) + _cause(exc)) from exc
                if cases[rank].status != "ok" and grace_until is None:
                    grace_until = time.monotonic() + FAILURE_GRACE_S
            if pending and grace_until is not None and time.monotonic() >= grace_until:
                stuck = sorted(refs.index(r) for r in pending)
                first_bad = next(c for c in cases.values() if c.status != "ok")
                self._gang.kill_actors()  # ranks stuck in a collective: fresh ones next time
                for rank in stuck:
                    cases[rank] = CaseOutcome(
                        rank=rank,
                        seq_len=config.seq_len,
                        status="failed",
                        error=f"abandoned {FAILURE_GRACE_S:g} s after rank {first_bad.rank} "
                        f"ended with {first_bad.status}",
                    )
                break
        if any(c.group_broken for c in cases.values()):
            # A ring abort left transfers unfinished in the process group: fresh ranks next.
            self._gang.kill_actors()
        return [cases[r] for r in range(len(refs))]


def _free_summary() -> str:
    info = describe()
    return f"{info['free_cpus']:g} CPU, {info['free_gpus']:g} GPU"


def _checked_device(config: RunConfig, kind: Kind) -> DeviceKind:
    """The device kind `config` runs on, once it is known to be a runnable run of `kind` that
    the cluster can hold (ValueError, Infeasible, or a missing reference's error otherwise)."""
    if kind not in ("benchmark", "max_seq_len", "correctness"):
        raise ValueError(f"kind: must be benchmark, max_seq_len or correctness, got {kind!r}")
    if kind == "max_seq_len" and config.search is None:
        raise ValueError("search: a max_seq_len run needs a search config")
    kernels.check_mode(config)
    if kernels.gated(config, kind):
        references.check_available(config.kernel, config.params)
    cluster = describe()
    check_feasible(config, cluster)
    return device_kind(config, cluster)


def pending_demand() -> set[str]:
    """The resources (CPU, GPU, ...) that Ray's pending work of anyone asks for: tasks and
    actors waiting for a node, and placement groups waiting for bundles, read from the GCS's
    autoscaler state (no dashboard needed)."""
    from ray.autoscaler.v2.sdk import get_cluster_resource_state  # Ray's autoscaler SDK

    state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
    wanted: set[str] = set()
    for pending in state.pending_resource_requests:
        wanted.update(k for k, v in pending.request.resources_bundle.items() if v > 0)
    for group in state.pending_gang_resource_requests:
        for request in group.requests:
            wanted.update(k for k, v in request.resources_bundle.items() if v > 0)
    return wanted


TRIM_EVERY_S = 1.0
"""How often a pool looks at its idle gangs (their TTL, and Ray's pending demand)."""


class GangPool:
    """Starts runs on gangs, keeps one warm gang for the next run with the same key, and gives
    an idle one back to Ray after `warm_ttl_s`, or at once when Ray has pending demand (anyone's
    task, actor or placement group) for the resource it holds."""

    def __init__(self, placement_timeout_s: float = 300.0, warm_ttl_s: float = 60.0) -> None:
        if warm_ttl_s < 0:
            raise ValueError(f"warm_ttl_s: must be >= 0, got {warm_ttl_s}")
        self.placement_timeout_s = placement_timeout_s
        self.warm_ttl_s = warm_ttl_s
        self._lock = threading.Lock()
        self._idle: list[Gang] = []
        self._busy: list[Gang] = []
        self._closed = threading.Event()
        self._trimmer = threading.Thread(
            target=self._trim_forever, name="ringlab-gang-trim", daemon=True
        )
        self._trimmer.start()

    def _trim_forever(self) -> None:
        while not self._closed.wait(TRIM_EVERY_S):
            try:
                self.trim()
            except Exception:  # Ray unreachable for a moment, or a bug: logged, tried again
                log.exception("looking at idle gangs failed; again in %g s", TRIM_EVERY_S)

    def trim(self) -> list[Gang]:
        """Remove the idle gangs past warm_ttl_s, and those holding a resource Ray's pending
        demand asks for (they would starve other schedulers and Ray users); those removed."""
        with self._lock:
            idle = list(self._idle)
        if not idle:
            return []
        now = time.monotonic()
        demand = pending_demand()
        drop = [
            g
            for g in idle
            if now - g.idle_since >= self.warm_ttl_s or bundle(g.key.device).keys() & demand
        ]
        with self._lock:
            drop = [g for g in drop if g in self._idle]  # taken by a run meanwhile: kept
            for gang in drop:
                self._idle.remove(gang)
        for gang in drop:
            log.info(
                "gave back an idle gang %s (%s)",
                gang.key,
                "idle TTL"
                if now - gang.idle_since >= self.warm_ttl_s
                else "Ray has pending demand",
            )
            gang.remove()
        return drop

    def start(
        self,
        config: RunConfig,
        kind: Kind,
        *,
        on_waiting: Callable[[], None] | None = None,
    ) -> RunHandle:
        """Start `config` as a run of `kind`; returns at once (after on_waiting, if it waits).

        Raises Infeasible when the cluster can never hold the gang, ValueError for a
        max_seq_len run without `search` or a correctness check with no reference to check
        against.
        """
        key = GangKey.of(config, _checked_device(config, kind))
        gang, cold = self._take(key, fresh_processes(config, kind))
        if cold:
            ready, _ = ray.wait([gang.ready_ref()], timeout=READY_AT_ONCE_S)
            if not ready and on_waiting is not None:
                on_waiting()
        handle = RunHandle(self, gang, config, kind, cold=cold)
        handle._thread.start()
        return handle

    def _take(self, key: GangKey, fresh: bool) -> tuple[Gang, bool]:
        """(a gang for `key`, now busy; whether it is cold). A warm idle one unless `fresh`;
        else a new one, every idle gang removed first (they hold resources the new one may
        need). A warm one that lost a rank while idle is discarded for a new one."""
        with self._lock:
            gang = None
            if not fresh:
                gang = next((g for g in self._idle if g.key == key), None)
            if gang is not None:
                self._idle.remove(gang)
            cold = gang is None
            stale: list[Gang] = []
            if cold:  # idle gangs hold resources the new one may need
                stale, self._idle = self._idle, []
            if gang is None:
                gang = Gang(key)
            self._busy.append(gang)
        for old in stale:
            old.remove()
        if not cold and not gang.alive():
            log.warning("warm gang %s lost a rank while idle; starting a new one", key)
            self._discard(gang)
            gang, cold = Gang(key), True
            with self._lock:
                self._busy.append(gang)
        return gang, cold

    def fits(self, config: RunConfig) -> bool:
        """Whether the cluster holds `config`'s W bundles now, beside every placement group
        that is not REMOVED (other gangs, other schedulers' and other jobs', pending ones
        included) except this pool's idle gangs (a new gang replaces them). Read from the
        GCS's group table, which a new group enters at once, where the nodes' free-resource
        reports lag: the scheduler asks this right after starting a gang."""
        cluster = describe()
        cuda = device_kind(config, cluster) == "cuda"
        resource = "GPU" if cuda else "CPU"
        total = float(cluster["total_gpus" if cuda else "total_cpus"])
        with self._lock:
            idle = {gang.pg.id.hex() for gang in self._idle}
        held = 0.0
        for group_id, group in placement_group_table().items():
            if group.get("state") == "REMOVED" or group_id in idle:
                continue
            held += sum(float(b.get(resource, 0.0)) for b in group.get("bundles", {}).values())
        return total - held >= config.world_size

    def close(self) -> None:
        """Kill every actor and remove every placement group this pool created."""
        self._closed.set()
        with self._lock:
            gangs, self._idle, self._busy = self._idle + self._busy, [], []
        for gang in gangs:
            gang.remove()

    def _release(self, gang: Gang) -> None:
        """Keep a gang whose run ended warm for the next run of its shape, unless another gang
        of this pool waits for bundles: an idle gang would hold them until that run timed out."""
        with self._lock:
            busy = gang in self._busy
            if busy:
                self._busy.remove(gang)
            others = list(self._busy)
        if busy and not any(other.waiting() for other in others):
            gang.idle_since = time.monotonic()
            with self._lock:
                self._idle.append(gang)
            return
        gang.remove()

    def _discard(self, gang: Gang) -> None:
        with self._lock:
            if gang in self._busy:
                self._busy.remove(gang)
        gang.remove()
