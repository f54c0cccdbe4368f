"""The ring's link, measured: before a sequence-parallel run's timed loop, every rank pings one
K/V block (the bytes one ring step sends: its k and v shard) to its next ring neighbour and back.

Why a probe: inside the ring loop a transfer's window (posting to completion) includes the time
its peer took to post the matching receive, so bytes / window measures the ranks' skew as much
as the link (14-46 MiB/s forward on loopback, where gloo moves 1.6-2.6 GB/s). This is
nccl-tests' sendrecv_perf instead: fixed bytes, warm-up round trips apart, then timed round
trips with nothing else of the run going on; one-way time = round trip / 2.

The fastest timed round trip counts, not the average nccl-tests reports on dedicated GPUs (as
STREAM keeps a bandwidth test's best trial and timeit its minimum): the block went there and
back in that time, so the link is at least that fast, and a slower round trip holds time a rank
waited for a CPU. On a shared host the difference is large: here, with other processes busy on
2 cores, 60 round trips of 2 MiB took 1.0-1.4 ms when both ranks ran and 3-10 ms when one was
preempted, so the median read a third of the link.

Schedule: the pairs (a, a+1 mod W) for a = 0 .. W-1, one pair at a time, in the same order on
every rank, so each link is measured alone and no rank can wait on a peer that waits on
another (at W=2 the link 0-1 is measured twice, once from each end: each rank keeps the figure
it timed). A rank times the pair it starts (its link to its next neighbour); the answering rank
echoes. Blocking send/recv on the default group: gloo for CPU tensors, NCCL for CUDA tensors,
with the device synchronized around every timed round trip.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attention.ring.comm import Tag

WARMUP_ROUND_TRIPS = 2
"""Untimed round trips of the block before timing (the first pays any lazy connection setup)."""
MIN_ROUND_TRIPS = 5
MAX_ROUND_TRIPS = 20
TIMED_BUDGET_S = 0.05
"""Timed round trips of the block per pair: as many as fit this budget, estimated from one
round trip after the warm-up, within [MIN_ROUND_TRIPS, MAX_ROUND_TRIPS]."""
LATENCY_ROUND_TRIPS = 10
"""Timed round trips of a tiny message (LATENCY_BYTES), after WARMUP_ROUND_TRIPS untimed."""
LATENCY_BYTES = 4


@dataclass(frozen=True)
class LinkFigures:
    """What one rank measured of its link to its next ring neighbour."""

    peer: int
    """The rank at the other end of the link (rank + 1 mod W)."""
    probe_bytes: int
    """Bytes of the block pinged: this rank's k and v shard."""
    bytes_per_s: float
    """probe_bytes / one-way time (the fastest timed round trip / 2)."""
    latency_s: float
    """One-way time of a LATENCY_BYTES message (the fastest timed round trip / 2)."""
    round_trips: int
    """Timed round trips of the block (the fastest of them counts)."""


def probe_ring_link(block_bytes: int, device: torch.device) -> LinkFigures:
    """Measure this rank's link to its next ring neighbour with a ping-pong of `block_bytes`
    (see the module docstring). Every rank of the default group must call it, at the same
    point; ranks may pass different sizes (uneven shards): a pair pings its starter's."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes: a K/V block has at least one byte, got {block_bytes}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("probe_ring_link: a ring link needs at least 2 ranks")
    sizes = _gather_sizes(block_bytes, device, world)
    mine: LinkFigures | None = None
    for starter in range(world):
        answerer = (starter + 1) % world
        if rank == starter:
            mine = _start_pair(answerer, sizes[starter], device)
        elif rank == answerer:
            _answer_pair(starter, sizes[starter], device)
    assert mine is not None  # every rank starts exactly one pair
    return mine


def _gather_sizes(block_bytes: int, device: torch.device, world: int) -> list[int]:
    """Every rank's block bytes (an all-gather: the answerer of a pair must post a receive of
    exactly the starter's size)."""
    mine = torch.tensor([block_bytes], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_trip(buf: torch.Tensor, peer: int, device: torch.device) -> float:
    """Send `buf` to `peer` and receive it back; seconds from the synchronized start to the
    synchronized end."""
    _sync(device)
    t0 = time.perf_counter()
    dist.send(buf, peer, tag=Tag.LINK_PROBE)
    dist.recv(buf, peer, tag=Tag.LINK_PROBE)
    _sync(device)
    return time.perf_counter() - t0


def _echo(buf: torch.Tensor, peer: int) -> None:
    """The answering end of one round trip."""
    dist.recv(buf, peer, tag=Tag.LINK_PROBE)
    dist.send(buf, peer, tag=Tag.LINK_PROBE)


def round_trips_for(estimate_s: float) -> int:
    """How many timed round trips fit TIMED_BUDGET_S at `estimate_s` each, within bounds."""
    if estimate_s <= 0:
        return MAX_ROUND_TRIPS
    fit = math.ceil(TIMED_BUDGET_S / estimate_s)
    return max(MIN_ROUND_TRIPS, min(MAX_ROUND_TRIPS, fit))


def _start_pair(peer: int, nbytes: int, device: torch.device) -> LinkFigures:
    """The starting end: warm up, size the timed loop and tell the peer, time the block's and
    the tiny message's round trips."""
    block = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    for _ in range(WARMUP_ROUND_TRIPS):
        _round_trip(block, peer, device)
    n = round_trips_for(_round_trip(block, peer, device))
    dist.send(torch.tensor([n], dtype=torch.int64, device=device), peer, tag=Tag.LINK_PROBE)
    block_rt = [_round_trip(block, peer, device) for _ in range(n)]
    tiny_rt = _tiny_round_trips(peer, device, starts=True)
    return LinkFigures(
        peer=peer,
        probe_bytes=nbytes,
        bytes_per_s=nbytes / (min(block_rt) / 2),
        latency_s=min(tiny_rt) / 2,
        round_trips=n,
    )


def _answer_pair(peer: int, nbytes: int, device: torch.device) -> None:
    """The answering end: echo every round trip the starter times, as many as it says."""
    block = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    for _ in range(WARMUP_ROUND_TRIPS + 1):
        _echo(block, peer)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, peer, tag=Tag.LINK_PROBE)
    for _ in range(int(count.item())):
        _echo(block, peer)
    _tiny_round_trips(peer, device, starts=False)


def _tiny_round_trips(peer: int, device: torch.device, *, starts: bool) -> list[float]:
    """WARMUP_ROUND_TRIPS untimed, then LATENCY_ROUND_TRIPS timed round trips of a
    LATENCY_BYTES message: the starting end returns the timed ones' seconds, the answering
    end echoes them all (and returns an empty list)."""
    tiny = torch.zeros(LATENCY_BYTES, dtype=torch.uint8, device=device)
    total = WARMUP_ROUND_TRIPS + LATENCY_ROUND_TRIPS
    if not starts:
        for _ in range(total):
            _echo(tiny, peer)
        return []
    times = [_round_trip(tiny, peer, device) for _ in range(total)]
    return times[WARMUP_ROUND_TRIPS:]
