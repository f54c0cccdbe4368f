"""Which runs shared a node while they ran: the co-tenant marks a contended timing carries.

The scheduler drives several gangs at once. Each run is `claimed` here, `placed` once its ranks
are up (the node ids they run on, and since when), and `ended` when the scheduler writes its
outcome. Its co-tenants are the runs whose placed intervals overlap its own on a shared node,
whichever ended first: an ended run is remembered while a run claimed before its end is still
in flight, so both sides of every overlap see each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Stay:
    run_id: int
    nodes: frozenset[str]
    since: float
    until: float = float("inf")


class Tenancy:
    """The placed intervals of this scheduler's runs, in wall-clock seconds (time.time())."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed: dict[int, float] = {}
        self._placed: dict[int, _Stay] = {}
        self._ended: list[_Stay] = []
        self._last_end = float("-inf")

    def claimed(self, run_id: int, at: float) -> None:
        """The run was claimed at `at`: ended runs overlapping it are kept until it ends."""
        with self._lock:
            self._claimed[run_id] = at

    def placed(self, run_id: int, nodes: Iterable[str], since: float) -> None:
        """The run's ranks hold `nodes` since `since`; later calls for it change nothing. A stay
        learned after another run ended starts no earlier than that end: the ended run's
        co-tenants are written already, and both sides of an overlap must name each other."""
        with self._lock:
            if run_id not in self._placed:
                start = max(since, self._last_end)
                self._placed[run_id] = _Stay(run_id, frozenset(nodes), start)

    def ended(self, run_id: int, at: float) -> list[int] | None:
        """The run ended at `at`: the sorted ids of the runs that shared one of its nodes while
        it was placed, or None if it was never placed. Forgets its claim."""
        with self._lock:
            self._claimed.pop(run_id, None)
            self._last_end = max(self._last_end, at)
            stay = self._placed.pop(run_id, None)
            if stay is not None:
                stay = _Stay(run_id, stay.nodes, stay.since, at)
                met = sorted(
                    other.run_id
                    for other in [*self._placed.values(), *self._ended]
                    if other.nodes & stay.nodes and other.since < at and other.until > stay.since
                )
                self._ended.append(stay)
            horizon = min(self._claimed.values(), default=float("inf"))
            self._ended = [s for s in self._ended if s.until >= horizon]
            return None if stay is None else met
