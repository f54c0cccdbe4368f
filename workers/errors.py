"""Typed errors the engine raises to the scheduler: why a gang could not run or broke."""

from __future__ import annotations

import traceback


def error_text(exc: BaseException) -> str:
    """One line for an error a case ended with: its type, message and where it was raised."""
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


class GangError(Exception):
    """Base of every error about a gang of rank actors."""


class Infeasible(GangError):
    """The cluster can never host this gang; the message names what is needed and what exists."""

    def __init__(self, needed: str, available: str) -> None:
        super().__init__(f"infeasible: the run needs {needed}; the cluster has {available}")
        self.needed = needed
        self.available = available


class RankFailed(GangError):
    """A rank died (actor error, killed process, lost node): the whole gang is broken."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(f"rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause


class PlacementTimeout(GangError):
    """The gang's bundles did not become ready within the deadline (the cluster stays busy)."""


class ActorsNotStarted(GangError):
    """The gang's bundles were placed but its rank actors did not start; the message carries
    Ray's own reason (the raylet's error log) when Ray gave one. Not retried: the same gang
    would fail the same way."""
