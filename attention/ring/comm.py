"""Ring communication: one P2P exchange per step (send to the next rank, receive from the previous),
posted with `batch_isend_irecv` so it runs while the current step computes.

The process group's backend moves the tensors: gloo for CPU tensors, NCCL for CUDA tensors (a
group made with backend "cpu:gloo,cuda:nccl" dispatches by the tensors' device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from attention.errors import ParamError, is_allocation_failure
from attention.ring.steps import clock


class Tag(enum.IntEnum):
    """Message tags of every P2P exchange of the ring kernels, in one place so none collide:
    two exchanges between the same ranks on one tag would be matched in posting order."""

    K = 0  # engine: a K piece travelling the ring
    DKV = 1  # engine: a dK/dV accumulator travelling home
    V = 2  # engine: a V piece (its own message: no stacked copy of a piece)
    SPARSE_KV_EVEN = 10  # ring_block_sparse: K/V of even steps (double-buffered)
    SPARSE_KV_ODD = 11  # ring_block_sparse: K/V of odd steps
    SPARSE_DKV = 12  # ring_block_sparse: partial dK/dV sent to their owner
    RELAYOUT = 20  # relayout: the all-to-all between layouts
    SEGMENT_GATHER = 30  # ring_dilated: a shared segment's dilated K/V rows
    SEGMENT_REDUCE = 31  # ring_dilated: a shared segment's dK/dV rows sent home
    LINK_PROBE = 40  # workers.link: the ping-pong that measures a ring link before a run
    ULYSSES = 50  # ulysses, usp: the all-to-all between tokens and heads (collectives)
    GATHER_NEEDED = 60  # allgather_kv, gather needed: the K/V rows a rank's queries keep
    GATHER_NEEDED_GRADS = 61  # allgather_kv, gather needed: their dK/dV rows sent home


def resolve_group(group: Any) -> Any:
    """The process group to use: `group`, or the default (world) group; errors if none exists."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring attention: torch.distributed is not initialised; call "
            "dist.init_process_group first (gloo for CPU tensors, nccl for CUDA tensors)"
        )
    return dist.group.WORLD if group is None else group


def rank_and_world(group: Any) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    group = dist.group.WORLD if group is None else group
    return dist.get_rank(group), dist.get_world_size(group)


def check_backend(group: Any, device: torch.device) -> None:
    """Raise ValueError when the group's backend cannot move tensors of `device`."""
    backend = str(dist.get_backend(group)).lower()
    if device.type == "cuda" and "nccl" not in backend:
        raise ValueError(
            f"group: CUDA tensors travel the ring over NCCL, but the group's backend is "
            f"{backend!r}; init it with 'nccl' or 'cpu:gloo,cuda:nccl'"
        )
    if device.type == "cpu" and backend == "nccl":
        raise ValueError(
            "group: NCCL cannot move CPU tensors; init the group with 'gloo' or "
            "'cpu:gloo,cuda:nccl'"
        )


def params_fingerprint(params: Any) -> int:
    """A stable 56-bit hash of a kernel's parameter dataclass, its process group left out."""
    if params is None:
        return 0
    fields = [(f.name, getattr(params, f.name)) for f in dataclasses.fields(params)]
    text = repr([(name, value) for name, value in fields if name != "group"])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def check_same_call(
    group: Any,
    q: torch.Tensor,
    causal: bool,
    params: Any = None,
    local_check: Callable[[], None] | None = None,
) -> None:
    """Raise ValueError on every rank unless all ranks call with the same q shape, dtype,
    `causal` and kernel parameters, and every rank's `local_check` (its own input checks) passed.

    One tiny all-gather per call. Without it a rank that rejects its inputs leaves the others
    blocked in the ring until the process-group timeout, and ranks built with different
    parameters (layout, pattern) would hang or silently compute a different attention.
    """
    local_error: ValueError | None = None
    if local_check is not None:
        try:
            local_check()
        except ValueError as exc:  # re-raised below, after the others have heard of it
            local_error = exc
    world = dist.get_world_size(group)
    if world == 1:
        if local_error is not None:
            raise local_error
        return
    shape = [*q.shape[:4], *[-1] * (4 - min(q.dim(), 4))]
    row = [*shape, q.dim(), _DTYPE_CODES.get(q.dtype, -1), int(causal)]
    meta = torch.tensor(
        [*row, params_fingerprint(params), int(local_error is not None)], dtype=torch.int64
    ).to(q.device)
    gathered = [torch.empty_like(meta) for _ in range(world)]
    wait_all([dist.all_gather(gathered, meta, group=group, async_op=True)])
    rows = [tuple(int(x) for x in m.cpu()) for m in gathered]
    if local_error is not None:
        raise local_error
    failed = [r for r, got in enumerate(rows) if got[-1]]
    if failed:
        raise ValueError(
            f"q, k, v: rank(s) {', '.join(map(str, failed))} rejected their inputs "
            "(see that rank's error); every rank stops"
        )
    if any(got[:7] != rows[0][:7] for got in rows):
        described = "; ".join(
            f"rank {r}: q {got[:4][: got[4]]}, dtype code {got[5]}, causal {bool(got[6])}"
            for r, got in enumerate(rows)
        )
        raise ValueError(
            "q, k, v: every rank of the ring must pass the same shape, dtype and causal flag; "
            f"got {described}"
        )
    if any(got[7] != rows[0][7] for got in rows):
        raise ParamError(
            "params",
            "every rank of the ring must build the kernel with the same parameters "
            f"(layout, pattern, segments, ...); this rank has {params!r}, and the parameter "
            f"fingerprints per rank are {[got[7] for got in rows]}",
        )


_DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
}


@dataclasses.dataclass
class Traffic:
    """Bytes this process's ring communication posted since `reset()` (every RingComm and
    `exchange`): what a step moves, for tests and benchmarks to read."""

    sent: int = 0
    received: int = 0

    def reset(self) -> None:
        self.sent = self.received = 0

    def add(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> int:
        """Count a posted transfer (and its sent bytes in the step clock's open step); returns
        the bytes it will receive."""
        sent = _nbytes(send)
        received = _nbytes(recv)
        self.sent += sent
        self.received += received
        clock.sent(sent)
        return received


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


traffic = Traffic()
"""The process-wide tally (one rank per process)."""


class RingComm:
    """Exchange with the ring neighbours: `start(send, recv)` posts send-to-next and
    receive-from-previous; `wait()` completes them. One exchange in flight per instance."""

    def __init__(self, group: Any, tag: int = 0, members: tuple[int, ...] | None = None) -> None:
        """`members`: the ring is these group ranks in this order (USP: one rank of each
        Ulysses group), and `rank`, `world_size` are this rank's place in it and its length;
        None: every rank of the group, in rank order."""
        self.group = group
        self.tag = tag
        self.members = members or tuple(range(dist.get_world_size(group)))
        self.rank = self.members.index(dist.get_rank(group))
        self.world_size = len(self.members)
        self._reqs: list[Any] | None = None
        self._posted: tuple[Any, int] = (None, 0)  # (clock mark, bytes to receive)

    def peer(self, offset: int) -> int:
        """Global rank of the ring member `offset` places after this one."""
        member = self.members[(self.rank + offset) % self.world_size]
        return dist.get_global_rank(self.group, member)

    def start(
        self, send: torch.Tensor | None, recv: torch.Tensor | None, *, offset: int = 1
    ) -> None:
        """Post sending `send` to the rank `offset` after this one and receiving into `recv`
        from the rank `offset` before it (offset 1: the ring neighbours).

        Either may be None (a block nobody needs is not sent; see ring_block_sparse); both ends
        must agree, which callers guarantee by deciding from information every rank has.
        """
        if self._reqs is not None:
            raise RuntimeError("RingComm.start: the previous exchange was not waited for")
        self._posted = (clock.mark(), traffic.add(send, recv))
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self.peer(offset), self.group, self.tag))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self.peer(-offset), self.group, self.tag))
        self._reqs = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> None:
        """Block until the posted exchange is complete (its buffers may then be reused); the
        time blocked is the open step's wait (attention.ring.steps)."""
        if self._reqs is None:
            raise RuntimeError("RingComm.wait: nothing was started")
        with clock.waiting():
            wait_all(self._reqs)
        clock.received(self._posted[1], self._posted[0])
        self._reqs = None


def exchange(
    group: Any,
    sends: dict[int, torch.Tensor],
    recvs: dict[int, torch.Tensor],
    tag: int,
) -> None:
    """Send sends[j] to, and receive recvs[j] from, the group ranks j; return when all are done.

    Every pair of ranks must post their matching exchanges in the same order (callers decide
    from information every rank has), so no subgroup is needed: torch names a locally created
    subgroup after how many groups each process made before, which differs between ranks that
    share different segments, and the rendezvous then never meets.
    """
    posted = clock.mark()
    for t in sends.values():
        traffic.add(t, None)
    received = sum(traffic.add(None, t) for t in recvs.values())
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, j), group, tag)
        for j, t in sends.items()
    ] + [
        dist.P2POp(dist.irecv, t, dist.get_global_rank(group, j), group, tag)
        for j, t in recvs.items()
    ]
    with clock.waiting():  # posted and completed here: all of it is time blocked
        wait_all(dist.batch_isend_irecv(ops) if ops else [])
    clock.received(received, posted)


ABORT_POLL_S = 0.05
"""How often a rank waiting on its peers reads the abort flag (inside an abort_scope)."""
_SLEEP_MIN_S = 5e-5
_SLEEP_MAX_S = 1e-3
"""Between completion checks of an NCCL work a waiting rank sleeps, doubling from the first to
the second: a transfer that lands at once costs microseconds, a long wait no CPU."""


class PeerAborted(Exception):
    """A peer of the ring published an abort (it raised mid-ring): this rank stopped waiting
    for it. `oom`: the peer's error was an allocation failure. Not a RuntimeError: its message
    quotes the peer's ("CUDA out of memory ..."), which must not read as this rank's own oom
    (attention.errors.is_allocation_failure)."""

    def __init__(self, rank: int, oom: bool, reason: str) -> None:
        super().__init__(f"rank {rank} stopped the ring: {reason}")
        self.rank = rank
        self.oom = oom
        self.reason = reason

    def __reduce__(self) -> tuple[type[PeerAborted], tuple[int, bool, str]]:
        return PeerAborted, (self.rank, self.oom, self.reason)


@dataclasses.dataclass
class AbortScope:
    """One abort_scope: its flag's key in the rendezvous store, and whether the ring broke
    (this rank published an abort or saw a peer's): its process group then holds unfinished
    transfers, and the process must run no further collective on it."""

    store: Any
    key: str
    rank: int
    nccl: bool
    broken: bool = False

    def check(self) -> None:
        """Raise PeerAborted if a peer published an abort in this scope."""
        if not self.store.check([self.key]):
            return
        rank, oom, reason = self.store.get(self.key).decode().split("\t", 2)
        self.broken = True
        self._abort_nccl()
        raise PeerAborted(int(rank), oom == "1", reason)

    def publish(self, exc: BaseException) -> None:
        """Tell every peer that this rank left the ring because of `exc` (first flag wins)."""
        self.broken = True
        oom = "1" if is_allocation_failure(exc) else "0"
        text = str(exc).splitlines()[0] if str(exc) else ""
        value = f"{self.rank}\t{oom}\t{type(exc).__name__}: {text}"
        self.store.compare_set(self.key, "", value)
        self._abort_nccl()

    def _abort_nccl(self) -> None:
        """Abort this process's NCCL communicators: their kernels waiting on a peer that left
        would hang every later CUDA synchronisation (gloo's unfinished transfers stay on a
        waiter thread, harmless to the host). Not run on this CPU-only machine."""
        if self.nccl:
            dist.distributed_c10d._abort_process_group()


_active: AbortScope | None = None
_generation = 0
_broken = False


@contextlib.contextmanager
def abort_scope() -> Iterator[AbortScope]:
    """While open, every wait of the ring kernels (and of wait_all's other callers) also reads
    the rendezvous store for a peer's abort flag, and an error raised inside publishes this
    rank's flag, so that the peers of a rank that ran out of memory mid-ring stop within
    ABORT_POLL_S instead of waiting out the process group's timeout.

    Every rank must open the same number of scopes in the same order (one per case): the
    flag's key counts them. After an abort (`scope.broken`) the process group holds
    unfinished transfers: the caller must run no further collective on it.
    """
    global _active, _generation
    if _active is not None:
        raise RuntimeError("abort_scope: a scope is already open")
    if _broken:
        raise RuntimeError(
            "abort_scope: an earlier ring abort left this process group with unfinished "
            "transfers; run no further collective on it (start fresh processes)"
        )
    group = resolve_group(None)
    _generation += 1
    scope = AbortScope(
        store=dist.distributed_c10d._get_default_store(),
        key=f"ringlab/abort/{_generation}",
        rank=dist.get_rank(group),
        nccl="nccl" in str(dist.get_backend(group)).lower(),
    )
    _active = scope
    try:
        yield scope
    except PeerAborted:
        raise
    except BaseException as exc:
        if dist.get_world_size(group) > 1:
            peer = _peer_abort_behind(scope, exc)
            if peer is not None:
                raise peer from exc
            try:
                scope.publish(exc)
            except dist.DistError as lost:  # the store is gone too: the error stays the cause
                exc.add_note(f"abort_scope: could not tell the peers: {lost}")
        raise
    finally:
        _active = None
        _mark_broken(scope.broken)


def _peer_abort_behind(scope: AbortScope, exc: BaseException) -> PeerAborted | None:
    """The peer's abort behind this rank's error, when one was published and the error is not
    this rank's own allocation failure: a transfer posted to a peer that left fails at once
    ("Connection closed by peer"), before any wait could read the flag."""
    if is_allocation_failure(exc):
        return None
    try:
        scope.check()
    except PeerAborted as peer:
        return peer
    except dist.DistError:  # the store is unreachable: this rank's error is all there is
        return None
    return None


def group_broken() -> bool:
    """Whether a ring abort (this rank's own error or a peer's) ever left this process's group
    with unfinished transfers: sticky, since those transfers never finish."""
    return _broken


def _mark_broken(broken: bool) -> None:
    global _broken
    _broken = _broken or broken


def wait_all(works: Iterable[Any]) -> None:
    """Complete every posted transfer or collective of `works` (their errors raised); outside
    an abort_scope, by blocking in `wait()`. Inside one the wait also reads the abort flag
    every ABORT_POLL_S and raises PeerAborted when a peer published one: gloo's P2P works
    cannot be polled (is_completed() stays False until wait() returns, and a wait with a
    timeout ends the work), so their wait() blocks on a waiter thread while this thread reads
    the flag; NCCL works are polled with is_completed() (their wait() only orders streams of
    the calling thread, so it stays here)."""
    scope = _active
    works = list(works)
    if scope is None:
        for work in works:
            work.wait()
    elif scope.nccl:
        _poll_works(scope, works)
    else:
        _waiter.wait(scope, works)


def _poll_works(scope: AbortScope, works: list[Any]) -> None:
    """Poll each work's is_completed() (sleeping a little longer each time), reading the abort
    flag every ABORT_POLL_S; then wait() (it raises the work's error)."""
    next_check = time.monotonic() + ABORT_POLL_S
    for work in works:
        delay = _SLEEP_MIN_S
        while not work.is_completed():
            if time.monotonic() >= next_check:
                scope.check()
                next_check = time.monotonic() + ABORT_POLL_S
            time.sleep(delay)
            delay = min(2 * delay, _SLEEP_MAX_S)
        try:
            work.wait()
        except RuntimeError:
            scope.check()  # a peer's abort is the cause of a lost connection
            raise


class _Waiter:
    """One daemon thread per process that blocks in the works' wait() for the calling thread,
    so that thread can read the abort flag meanwhile. After an abort the thread stays blocked
    on the transfers that never finish (the process group is broken: scope.broken), and a
    daemon thread does not keep the process from exiting."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[list[Any], _Done]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def wait(self, scope: AbortScope, works: list[Any]) -> None:
        """Block until `works` are done (raising their error) or a peer aborts (PeerAborted)."""
        self._start()
        done = _Done()
        self._requests.put((works, done))
        while not done.event.wait(ABORT_POLL_S):
            scope.check()
        if done.error is not None:
            scope.check()  # a peer that aborted and exited resets its connections: the cause
            raise done.error

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="ringlab-ring-waiter", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            works, done = self._requests.get()
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:  # handed to the calling thread, raised there
                done.error = exc
            done.event.set()


@dataclasses.dataclass
class _Done:
    """A waiter request's completion: set once its works finished, with their error if any."""

    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


_waiter = _Waiter()
