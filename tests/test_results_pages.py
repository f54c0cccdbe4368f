"""A page of a sweep's rows, or a few chosen runs, reads as the whole sweep's rows do: the same
labels, baselines and ratios, although it reads only those runs and their baselines."""

from __future__ import annotations

from typing import Any

from _web_helpers import seed_sweeps
from sqlalchemy import select
from sqlalchemy.orm import Session
from test_seed_tables import _dp_sweep, client_for

from service import queries
from service.db.engine import make_engine
from service.db.models import Sweep


def dicts(rows: list[Any]) -> list[dict[str, Any]]:
    return [r.as_dict() for r in rows]


def test_pages_and_chosen_runs_read_as_the_whole_sweep(database_url: str) -> None:
    seed_sweeps(database_url)
    with client_for(database_url) as client:
        _dp_sweep(client)  # world-size baselines, data and sequence parallel
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            sweeps = session.scalars(select(Sweep).order_by(Sweep.id)).all()
            assert len(sweeps) == 4
            for sweep in sweeps:
                whole = queries.sweep_rows(session, sweep)
                assert any(r.baseline_run_id for r in whole) or sweep.kind == "max_seq_len"
                paged: list[Any] = []
                after = 0
                while page := queries.rows_page(session, sweep, after=after, limit=2):
                    paged += page
                    after = page[-1].run_id
                assert dicts(paged) == dicts(whole), sweep.name
                chosen = [whole[-1].run_id, whole[0].run_id]
                picked = queries.rows_page(session, sweep, run_ids=chosen)
                assert dicts(picked) == dicts([whole[0], whole[-1]])
    finally:
        engine.dispose()


def test_the_context_pass_reads_in_chunks(database_url: str, monkeypatch: Any) -> None:
    """A context found 2 runs at a time equals one found at once (the chunk boundary is not a
    boundary of the sweep)."""
    with client_for(database_url) as client:
        runs = _dp_sweep(client)
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            sweep = session.get(Sweep, runs[0]["sweep_id"])
            assert sweep is not None
            queries._contexts.clear()
            once = queries.sweep_context(session, sweep)
            queries._contexts.clear()
            monkeypatch.setattr(queries, "CONTEXT_CHUNK", 2)
            chunked = queries.sweep_context(session, sweep)
            assert chunked == once and len(once.refs) > 2
    finally:
        engine.dispose()
        queries._contexts.clear()
