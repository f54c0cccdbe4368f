"""Ring communication: one P2P exchange per step (send to the next rank, receive from the previous),
posted with `batch_isend_irecv` so it runs while the current step computes.

The process group's backend moves the tensors: gloo for CPU tensors, NCCL for CUDA tensors (a
group made with backend "cpu:gloo,cuda:nccl" dispatches by the tensors' device).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from attention.errors import ParamError
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
    dist.all_gather(gathered, meta, group=group)
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

    def __init__(self, group: Any, tag: int = 0) -> None:
        self.group = group
        self.tag = tag
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._reqs: list[Any] | None = None
        self._posted: tuple[Any, int] = (None, 0)  # (clock mark, bytes to receive)

    def peer(self, offset: int) -> int:
        """Global rank of the group member `offset` places after this one on the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world_size)

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
            for req in self._reqs:
                req.wait()
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
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
    clock.received(received, posted)
