"""The ring link probe (workers.link) on real gloo ranks: every rank of a W=2, 3 or 4 ring gets
the figures of its link to its next rank, with no deadlock, quickly."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from _dist_helpers import run_ranks

from workers import link


def probe_only(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """This rank's link figures, and the seconds the probe took it."""
    started = time.perf_counter()
    figures = link.probe_ring_link(sizes[rank], torch.device("cpu"))
    return {**dataclasses.asdict(figures), "probe_s": time.perf_counter() - started}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_measures_the_link_to_its_next_rank(world: int) -> None:
    """Blocks of different sizes per rank (uneven shards): a pair pings its starter's."""
    sizes = [(256 << 10) + 4096 * r for r in range(world)]
    got = run_ranks(probe_only, world, sizes)
    for r, figures in enumerate(got):
        assert figures["peer"] == (r + 1) % world and figures["probe_bytes"] == sizes[r]
        assert figures["bytes_per_s"] > 0 and 0 < figures["latency_s"] < 1
        assert link.MIN_ROUND_TRIPS <= figures["round_trips"] <= link.MAX_ROUND_TRIPS
    # cheap: W pairs of about TIMED_BUDGET_S each (0.1-0.4 s here on 2 busy cores)
    print(f"W={world}: the probe took {max(f['probe_s'] for f in got):.2f} s")
    assert max(f["probe_s"] for f in got) < 2.0


def test_the_timed_round_trips_fit_the_budget_within_bounds() -> None:
    assert link.round_trips_for(link.TIMED_BUDGET_S / 7) == 7
    assert link.round_trips_for(10.0) == link.MIN_ROUND_TRIPS
    assert link.round_trips_for(1e-9) == link.MAX_ROUND_TRIPS
