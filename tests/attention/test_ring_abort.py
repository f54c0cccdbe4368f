"""A rank that runs out of memory mid-ring stops its peers at once (issue 37 item 4.5): inside
`abort_scope` the failing rank publishes an abort flag in the rendezvous store, and every peer
waiting on it (a ring transfer, a barrier, an all_reduce) raises PeerAborted within
ABORT_POLL_S instead of waiting out the process-group timeout (20 s in these processes).

The allocation failure is injected by the test (the engine's block primitive is wrapped in the
rank's process), so the production code carries no test hook."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import PG_TIMEOUT_S, run_ranks

import attention
from attention import layouts
from attention.ring import comm, engine
from workers import protocol
from workers.config import RunConfig
from workers.results import CaseOutcome, outcome_of

pytestmark = pytest.mark.timeout(120)

SHAPE = (1, 64, 2, 8)  # batch, total seq, heads, head_dim
RETURN_WITHIN_S = 10.0
ASKED = "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)"
FAILED_AT: list[float] = []
"""When this process's injected failure was raised (wall clock: ranks share the host)."""


def _inject_oom(name: str, rank: int, bad_rank: int, at_call: int) -> None:
    """Make this process's `engine.<name>` raise torch.OutOfMemoryError on its `at_call`-th
    call when this is `bad_rank` (every other rank keeps the real primitive)."""
    real = getattr(engine, name)
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at_call:
            FAILED_AT.append(time.time())
            raise torch.OutOfMemoryError(ASKED)
        return real(*args, **kwargs)

    if rank == bad_rank:
        setattr(engine, name, failing)


KERNELS: dict[str, dict[str, Any]] = {
    "ring": {"layout": "contiguous"},
    "ring_block_sparse": {
        "layout": "contiguous",
        "block_size": 4,
        "pattern": "global_local",
        "window": 1,
        "num_global": 1,
    },
}
"""The ring kernels whose blocks go through the engine's primitive calls (where the failure
is injected); ring_dilated gathers its segments with `exchange`, another wait_all caller."""


def oom_mid_ring(
    rank: int, world: int, bad_rank: int, backward: bool, kernel: str = "ring"
) -> dict[str, Any]:
    """One ring forward (and backward) in an abort scope, `bad_rank` failing at its second
    block; returns how this rank left the scope and how long it took."""
    engine.PIECE_TOKENS = 8  # several pieces per shard: the failure lands mid-ring
    _inject_oom("block_backward" if backward else "block_forward", rank, bad_rank, at_call=2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        layouts.shard(torch.randn(*SHAPE, generator=g), "contiguous", rank, world).requires_grad_()
        for _ in range(3)
    )
    module = attention.build(kernel, **KERNELS[kernel])
    dist.barrier()
    start = time.monotonic()
    try:
        with comm.abort_scope() as scope:
            out = module(q, k, v, causal=False)
            if backward:
                out.sum().backward()
            wait_barrier = dist.barrier(async_op=True)  # a peer that finished waits here
            comm.wait_all([wait_barrier])
        return {"how": "finished", "s": time.monotonic() - start}
    except comm.PeerAborted as exc:
        how = {"how": "peer", "peer": exc.rank, "oom": exc.oom, "reason": exc.reason}
    except torch.OutOfMemoryError as exc:
        how = {"how": "oom", "error": str(exc)}
    elapsed = time.monotonic() - start
    _keep_the_store_up(rank, world)
    return {**how, "s": elapsed, "broken": scope.broken}


def _keep_the_store_up(rank: int, world: int) -> None:
    """Rank 0 hosts the rendezvous store: it returns (and its process exits) only once every
    rank has left its scope, as a gang's rank 0 actor stays up between cases."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/returned/{rank}", "1")
    if rank == 0:
        store.wait([f"test/returned/{r}" for r in range(world)], timedelta(seconds=30))


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_an_oom_mid_ring_returns_every_rank_promptly(
    world: int, backward: bool, kernel: str
) -> None:
    bad = world - 1
    results = run_ranks(oom_mid_ring, world, bad, backward, kernel, deadline_s=60)
    assert results[bad]["how"] == "oom" and results[bad]["broken"]
    assert "Tried to allocate 2.00 GiB" in results[bad]["error"]
    for rank, got in enumerate(results):
        assert got["s"] <= RETURN_WITHIN_S < PG_TIMEOUT_S, (rank, got)
        if rank != bad:
            assert got["how"] == "peer", (rank, got)
            assert got["peer"] == bad and got["oom"] and got["broken"]
            assert "OutOfMemoryError" in got["reason"] and "2.00 GiB" in got["reason"]


def ring_without_failure(rank: int, world: int) -> dict[str, Any]:
    """A ring forward and backward inside an abort scope, nobody failing: the scope is
    invisible (same output as outside it) and leaves the group usable."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        layouts.shard(torch.randn(*SHAPE, generator=g), "contiguous", rank, world).requires_grad_()
        for _ in range(3)
    )
    module = attention.build("ring", layout="contiguous")
    outside = module(q, k, v, causal=True).detach()
    with comm.abort_scope() as scope:
        inside = module(q, k, v, causal=True)
        inside.sum().backward()
    dist.barrier()  # the group still works
    return {"same": torch.equal(outside, inside.detach()), "broken": scope.broken}


def test_an_abort_scope_without_failure_changes_nothing() -> None:
    for got in run_ranks(ring_without_failure, 2):
        assert got == {"same": True, "broken": False}


def test_a_peer_abort_pickles_with_its_fields() -> None:
    import pickle

    exc = pickle.loads(pickle.dumps(comm.PeerAborted(3, True, "OutOfMemoryError: x")))
    assert (exc.rank, exc.oom, exc.reason) == (3, True, "OutOfMemoryError: x")
    assert str(exc) == "rank 3 stopped the ring: OutOfMemoryError: x"


def run_case_oom_in_timed_loop(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """protocol.run_case as `rank`; the last rank runs out of memory at its second ring block
    of the measured loop (armed when it starts: priming and the gate run the real kernel)."""
    name = "block_backward" if config["mode"] == "train" else "block_forward"
    real_loop = protocol._timed_loop

    def armed_loop(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("record_steps", True):  # the measured loop, not the priming one
            _inject_oom(name, rank, world - 1, at_call=2)
        return real_loop(*args, **kwargs)

    protocol._timed_loop = armed_loop
    case = protocol.run_case(RunConfig.model_validate(config), rank)
    returned_at = time.time()
    _keep_the_store_up(rank, world)
    return {"case": case.model_dump(mode="json"), "at": returned_at, "failed_at": FAILED_AT}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_run_whose_rank_ooms_mid_ring_is_an_oom_with_the_bytes_asked(
    world: int, mode: str
) -> None:
    config = {
        "kernel": "ring",
        "num_heads": 2,
        "head_dim": 8,
        "seq_len": 256,
        "world_size": world,
        "mode": mode,
        "device": "cpu",
        "warmup": 1,
        "iterations": 3,
    }
    got = run_ranks(run_case_oom_in_timed_loop, world, config, deadline_s=90)
    cases = [CaseOutcome.model_validate(g["case"]) for g in got]
    (failed_at,) = got[-1]["failed_at"]
    for g, case in zip(got, cases, strict=True):
        assert case.status == "oom" and case.group_broken, case.error
        assert g["at"] - failed_at <= RETURN_WITHIN_S, (case.rank, g["at"] - failed_at)
    assert cases[-1].requested_bytes == 2 << 30
    assert all("stopped waiting: rank" in (c.error or "") for c in cases[:-1])
    outcome = outcome_of(cases, world)
    assert outcome.status == "oom" and "Tried to allocate 2.00 GiB" in (outcome.error or "")


def send_after_the_peer_left(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 raises in its scope (not an oom) and its process exits; rank 0 then posts a send
    to it, which fails at once: the peer's abort, not the lost connection, is what it raises."""
    with pytest.raises(BaseException) as caught, comm.abort_scope() as scope:
        if rank == 1:
            raise ValueError("rank one gives up")
        scope.store.wait([scope.key], timedelta(seconds=20))
        time.sleep(1.0)  # rank 1's process is gone by now
        ring = comm.RingComm(dist.group.WORLD)
        ring.start(torch.ones(4), torch.empty(4))
        ring.wait()
    exc = caught.value
    if rank == 1:
        return {"type": type(exc).__name__}
    assert isinstance(exc, comm.PeerAborted)
    return {
        "type": "PeerAborted",
        "oom": exc.oom,
        "reason": exc.reason,
        "cause": repr(exc.__cause__),
    }


def test_a_transfer_to_a_peer_that_left_raises_its_abort() -> None:
    left, stayed = run_ranks(send_after_the_peer_left, 2)[::-1]
    assert left == {"type": "ValueError"}
    assert stayed["type"] == "PeerAborted" and not stayed["oom"]
    assert stayed["reason"] == "ValueError: rank one gives up"


def run_case_oom_in_the_gate(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """protocol.run_case as `rank`; the last rank runs out of memory at its second ring block,
    which the correctness gate (the case's first kernel calls) runs."""
    _inject_oom("block_forward", rank, world - 1, at_call=2)
    case = protocol.run_case(RunConfig.model_validate(config), rank)
    returned_at = time.time()
    _keep_the_store_up(rank, world)
    return {"case": case.model_dump(mode="json"), "at": returned_at, "failed_at": FAILED_AT}


def test_an_oom_in_the_gates_ring_stops_every_rank_as_oom() -> None:
    config = {
        "kernel": "ring",
        "num_heads": 2,
        "head_dim": 8,
        "seq_len": 256,
        "world_size": 2,
        "mode": "forward",
        "device": "cpu",
        "warmup": 1,
        "iterations": 2,
    }
    got = run_ranks(run_case_oom_in_the_gate, 2, config, deadline_s=60)
    cases = [CaseOutcome.model_validate(g["case"]) for g in got]
    (failed_at,) = got[-1]["failed_at"]
    for g, case in zip(got, cases, strict=True):
        assert case.status == "oom" and case.group_broken, case.error
        assert g["at"] - failed_at <= RETURN_WITHIN_S
    assert "the correctness check" in (cases[1].error or "")
    assert cases[1].requested_bytes == 2 << 30
    assert "stopped waiting: rank 1" in (cases[0].error or "")
