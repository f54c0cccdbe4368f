"""Run a function on W real gloo processes for tests: fails fast with the failing rank's traceback.

Processes come from a forkserver that has torch, attention, the workers' protocol and the test
helpers preloaded (a fork each, not a fresh interpreter); each rank joins a gloo group on a free
loopback port with a short timeout. Results travel back as torch.save bytes (CPU tensors, no
shared-memory handles).
"""

from __future__ import annotations

import io
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 20.0
"""Process-group timeout: a collective that waits longer on a dead peer raises."""

_CTX = mp.get_context("forkserver")
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "attention",
    "pytest",
    "workers.protocol",
    "_workers_helpers",
    "_api_helpers",
    "service.cli",
    "service.scheduler",
]
"""Imported once by the forkserver, so a rank's fork has them: a rank function's test module
(imported in every rank to unpickle the function) imports these, and with them unloaded each
rank of test_link or test_adapters spent 1.3-1.7 s of CPU importing the service and Ray."""
_CTX.set_forkserver_preload(FORKSERVER_PRELOAD)


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread inside: on a small shared machine two OpenMP threads contending with
    other processes make tiny training steps several times slower (what they count and the
    memory they measure are the same)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RankFailed(AssertionError):
    """A rank raised (its traceback is the message) or died, or the ranks ran past the deadline."""


def free_port() -> int:
    """A TCP port free on loopback right now (the socket is closed before torch binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _to_wire(obj: Any) -> bytes:
    """Bytes of `obj` by torch.save (tensors copied to CPU; no shared-memory handles)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_wire(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _join_group(rank: int, world: int, port: int) -> None:
    """Join the gloo group on loopback `port` with one thread (the W ranks share the machine's
    cores); a collective waiting on a dead peer raises after PG_TIMEOUT_S."""
    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{port}"
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world, timeout=timeout
    )


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results: Any
) -> None:
    try:
        _join_group(rank, world, port)
        value = fn(rank, world, *args)
        results.put((rank, "ok", _to_wire(value)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:  # only after reporting: peers then see a closed connection, not the cause
        if dist.is_initialized():
            dist.destroy_process_group()


SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out")
"""Messages of ranks that failed because a peer went away: consequences, not causes."""


def _describe_failure(world: int, errors: dict[int, str], results: Any) -> str:
    """The root cause first: errors arriving within a second are gathered, and one that is not
    a lost-peer error names the failing rank."""
    until = time.monotonic() + 1.0
    while time.monotonic() < until and len(errors) < world:
        try:
            rank, status, value = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = value
    causes = [r for r, tb in errors.items() if not any(s in tb for s in SECONDARY_ERRORS)]
    first = causes[0] if causes else next(iter(errors))
    others = sorted(set(errors) - {first})
    tail = f"\n(ranks {others} failed too, after it)" if others else ""
    return f"rank {first} of {world} failed:\n{errors[first]}{tail}"


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = 60.0
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo processes; returns results in rank order.

    The first rank to raise makes this raise RankFailed with its traceback at once (the other
    ranks are killed); a rank that dies silently or a run past `deadline_s` raises too.
    `fn` must be importable (a module-level function).
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, deadline_s)
        except RankFailed as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world: int, args: tuple, deadline_s: float) -> list[Any]:
    results = _CTX.Queue()
    port = free_port()
    procs = [
        _CTX.Process(target=_rank_main, args=(fn, r, world, port, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)
                ]
                if dead:
                    codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in dead)
                    raise RankFailed(f"rank process died without a result ({codes})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(got))
                    raise RankFailed(
                        f"ranks {missing} gave no result within {deadline_s:g} s"
                    ) from None
                continue
            if status == "error":
                raise RankFailed(_describe_failure(world, {rank: value}, results))
            got[rank] = _from_wire(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
    return [got[r] for r in range(world)]
