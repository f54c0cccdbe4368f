"""What the dashboard reads from the database: sweeps with their counts, result rows, one run,
and the matching cells of two sweeps. Queries go through the ORM; no number is made up here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from service.db.models import TERMINAL_STATUSES, Run, RunStatus, Sweep
from service.web.rows import run_row

STATE_ORDER = [s.value for s in RunStatus]

# A matching cell is a regression when B's throughput falls, or its peak memory or
# maximum length moves the wrong way, by more than this fraction (wide: the machines are noisy).
REGRESSION_TOLERANCE = 0.10


@dataclass
class SweepSummary:
    """A sweep with its run counts per state and how much of it has ended."""

    id: int
    name: str
    kind: str
    created_at: Any
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return sum(n for s, n in self.counts.items() if RunStatus(s) in TERMINAL_STATUSES)

    @property
    def finished(self) -> bool:
        return self.done == self.total

    @property
    def progress(self) -> float:
        return self.done / self.total if self.total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "counts": self.counts,
            "total": self.total,
            "done": self.done,
            "finished": self.finished,
            "progress": self.progress,
        }


def _counts(session: Session, sweep_ids: list[int]) -> dict[int, dict[str, int]]:
    rows = session.execute(
        select(Run.sweep_id, Run.status, func.count())
        .where(Run.sweep_id.in_(sweep_ids))
        .group_by(Run.sweep_id, Run.status)
    ).all()
    out: dict[int, dict[str, int]] = {i: {} for i in sweep_ids}
    for sweep_id, status, n in rows:
        out[sweep_id][RunStatus(status).value] = n
    return {i: {s: c[s] for s in STATE_ORDER if s in c} for i, c in out.items()}


def list_sweeps(session: Session, skip: int = 0, limit: int = 50) -> tuple[list[SweepSummary], int]:
    """The newest sweeps first, with their counts, and how many sweeps there are in all."""
    total = session.scalar(select(func.count()).select_from(Sweep)) or 0
    sweeps = session.scalars(
        select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc()).offset(skip).limit(limit)
    ).all()
    counts = _counts(session, [s.id for s in sweeps]) if sweeps else {}
    return [
        SweepSummary(s.id, s.name, str(s.kind.value), s.created_at, counts[s.id]) for s in sweeps
    ], total


def sweep_summary(session: Session, sweep_id: int) -> SweepSummary | None:
    """One sweep with its counts, or None when there is no such sweep."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        return None
    counts = _counts(session, [sweep_id])[sweep_id]
    return SweepSummary(sweep.id, sweep.name, str(sweep.kind.value), sweep.created_at, counts)


def sweep_rows(session: Session, sweep_id: int) -> list[dict[str, Any]]:
    """Every run of a sweep as a result row, in id order."""
    runs = session.scalars(
        select(Run)
        .where(Run.sweep_id == sweep_id)
        .options(
            selectinload(Run.rank_results),
            selectinload(Run.probes),
            selectinload(Run.environment),
        )
        .order_by(Run.id)
    ).all()
    return [run_row(r) for r in runs]


def get_run(session: Session, run_id: int) -> Run | None:
    """One run with its ranks, probes, environment and sweep loaded."""
    return session.scalars(
        select(Run)
        .where(Run.id == run_id)
        .options(
            selectinload(Run.rank_results),
            selectinload(Run.probes),
            selectinload(Run.environment),
            selectinload(Run.sweep),
        )
    ).first()


def unmatched(a_rows: list[dict[str, Any]], b_rows: list[dict[str, Any]]) -> tuple[int, int]:
    """How many cells are only in A, and only in B (no run with the same config in the other)."""
    a_keys = {r["config_key"] for r in a_rows}
    b_keys = {r["config_key"] for r in b_rows}
    return len(a_keys - b_keys), len(b_keys - a_keys)


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def compare_rows(a_rows: list[dict[str, Any]], b_rows: list[dict[str, Any]]) -> list[dict]:
    """Pairs of runs with the same config in sweeps A and B, with B/A ratios and a verdict.

    Regression: B's tokens/s below A's, or B's peak memory above A's, or B's maximum length
    below A's, by more than REGRESSION_TOLERANCE; or A succeeded and B did not.
    """
    b_by_key = {r["config_key"]: r for r in b_rows}
    tol = REGRESSION_TOLERANCE
    pairs = []
    for a in a_rows:
        b = b_by_key.get(a["config_key"])
        if b is None:
            continue
        tps = _ratio(b["tokens_per_s"], a["tokens_per_s"])
        mem = _ratio(b["peak_memory_bytes"], a["peak_memory_bytes"])
        maxlen = _ratio(b["max_seq_len"], a["max_seq_len"])
        reasons = []
        if a["status"] == "succeeded" and b["status"] != "succeeded":
            reasons.append(f"B {b['status']}")
        if tps is not None and tps < 1 - tol:
            reasons.append("slower")
        if mem is not None and mem > 1 + tol:
            reasons.append("more memory")
        if maxlen is not None and maxlen < 1 - tol:
            reasons.append("shorter max length")
        label = f"{a['variant']} · seq {a['seq_len']} · W={a['world_size']} · {a['dtype']}"
        label += f" · {a['mode']}" + (" · causal" if a["causal"] else "")
        pairs.append(
            {
                "label": label,
                "a": a,
                "b": b,
                "tps_ratio": tps,
                "memory_ratio": mem,
                "max_len_ratio": maxlen,
                "regression": bool(reasons),
                "reasons": reasons,
            }
        )
    return pairs
