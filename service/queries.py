"""Reads behind every results page and export: a sweep's rows (service.views) with their
baselines, ratios and labels (service.analysis), in four queries whatever the sweep's size.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from service import analysis
from service.api.store import components_for_sweep, results_for_sweep, sweep_runs
from service.db.models import Environment, Run, Sweep
from service.spec import AnalysisSpec
from service.views import RunRow, rows_of, run_row


def analysis_of(sweep: Sweep) -> AnalysisSpec | None:
    """The sweep's analysis block as submitted (None: the defaults)."""
    block = (sweep.spec or {}).get("analysis")
    return None if block is None else AnalysisSpec.model_validate(block)


def sweep_rows(session: Session, sweep: Sweep) -> list[RunRow]:
    """Every run of the sweep as a row, in id order, with baselines, ratios and labels."""
    runs = sweep_runs(session, sweep.id)
    ranks, probes = results_for_sweep(session, sweep.id)
    env_ids = {r.environment_id for r in runs if r.environment_id is not None}
    envs = {
        e.id: e for e in session.scalars(select(Environment).where(Environment.id.in_(env_ids)))
    }
    rows = rows_of(runs, ranks, probes, envs, components_for_sweep(session, sweep.id))
    analysis.apply(rows, analysis_of(sweep))
    analysis.set_labels(rows)
    return rows


def one_run(session: Session, run_id: int) -> tuple[Run, RunRow] | None:
    """A run (ranks, probes, environment and sweep loaded) and its row, labelled within its
    sweep and with its baseline; None when there is no such run."""
    run = session.scalars(
        select(Run)
        .where(Run.id == run_id)
        .options(
            selectinload(Run.rank_results),
            selectinload(Run.probes),
            selectinload(Run.environment),
            selectinload(Run.sweep),
        )
    ).first()
    if run is None:
        return None
    row = next((r for r in sweep_rows(session, run.sweep) if r.run_id == run_id), None)
    if row is None:
        components = components_for_sweep(session, run.sweep_id).get(run.id, [])
        row = run_row(run, run.rank_results, run.probes, run.environment, components)
    return run, row
