"""A run whose ring aborted (a case with group_broken) leaves no rank process behind for the
next case: the gang kills its actors, so a max_seq_len search's next probe spawns fresh ones
(issue 37 item 4.5). Ray is faked at the gang's two calls (ray.wait, ray.get): what is tested
is the gang's decision; tests/test_ring_abort.py runs the abort itself on real gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from _workers_helpers import config

from workers import gang
from workers.results import CaseOutcome


class FakeGang:
    """The gang fields RunHandle._collect reads, and a record of kill_actors calls."""

    def __init__(self, cases: list[CaseOutcome]) -> None:
        self.actors = [
            SimpleNamespace(run_case=SimpleNamespace(remote=lambda *_a, c=c: c)) for c in cases
        ]
        self.placement: list[Any] = []
        self.killed = 0

    def kill_actors(self) -> None:
        self.killed += 1
        self.actors = []


def _collect(monkeypatch: pytest.MonkeyPatch, cases: list[CaseOutcome]) -> FakeGang:
    """RunHandle._collect over a fake gang whose ranks return `cases` at once."""
    fake_ray = SimpleNamespace(
        wait=lambda pending, num_returns, timeout: (pending[:1], pending[1:]),
        get=lambda ref: ref,
    )
    monkeypatch.setattr(gang, "ray", fake_ray)
    fake = FakeGang(cases)
    handle = object.__new__(gang.RunHandle)
    handle._gang = fake  # type: ignore[assignment]
    handle._killed = None
    got = handle._collect(config(kernel="ring", world_size=2), "benchmark")
    assert got == cases
    return fake


def _case(rank: int, status: str, broken: bool) -> CaseOutcome:
    return CaseOutcome(rank=rank, seq_len=512, status=status, group_broken=broken)


def test_a_broken_ring_kills_the_gangs_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _collect(monkeypatch, [_case(0, "oom", True), _case(1, "oom", True)])
    assert fake.killed == 1 and fake.actors == []


def test_an_oom_that_left_the_group_whole_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emulated oom (a CPU peak over the budget) ends every rank cleanly: the gang stays."""
    fake = _collect(monkeypatch, [_case(0, "oom", False), _case(1, "oom", False)])
    assert fake.killed == 0 and len(fake.actors) == 2
