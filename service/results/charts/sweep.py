"""The charts of a sweep page, keyed by the element that draws each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.results.charts.common import Row, Styles
from service.results.charts.documents import documents_figure
from service.results.charts.performance import (
    SCALING_MIN_WORLD_SIZES,
    max_len_figure,
    memory_figure,
    peak_fraction_figure,
    scaling_figure,
    throughput_figure,
    world_sizes,
)
from service.results.charts.ring import exposed_comm_figure, sp_schemes_figure
from service.results.charts.training import components_figure, model_peak_figure, step_time_figure


def _points(figure: dict[str, Any]) -> set[tuple[Any, Any, Any]]:
    """The (run, x, y) points a figure draws (runs from its traces' customdata)."""
    found = set()
    for t in figure.get("data", []):
        columns = (t.get("customdata") or [], t.get("x") or [], t.get("y") or [])
        found |= set(zip(*columns, strict=False))
    return found


def _drawn(figure: dict[str, Any]) -> bool:
    """Whether a figure has anything on it (an empty one only says why)."""
    return bool(figure.get("data"))


def sweep_figures(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """The charts of the sweep page its rows fill, keyed by the element id that draws each:
    a panel with nothing to show is left out (the page draws one that fills later, live);
    scaling only with at least 3 world sizes (else scaling_table); the sequence-parallel
    schemes only when they are not the throughput chart again (a sweep of those schemes
    alone); a sweep with model cells adds seed 004's three."""
    styles = Styles(rows)
    figures = {
        "chart-throughput": throughput_figure(rows, styles),
        "chart-memory": memory_figure(rows, styles),
        "chart-maxlen": max_len_figure(rows),
    }
    if len(world_sizes(rows)) >= SCALING_MIN_WORLD_SIZES:
        figures["chart-scaling"] = scaling_figure(rows)
    if any(r.peak_fraction is not None for r in rows):
        figures["chart-peak"] = peak_fraction_figure(rows, styles)
    if any(r.exposed_comm_share is not None for r in rows):
        figures["chart-comm"] = exposed_comm_figure(rows, styles)
    schemes = sp_schemes_figure(rows, styles)
    if _points(schemes) != _points(figures["chart-throughput"]):  # else the same chart twice
        figures["chart-sp-schemes"] = schemes
    figures["chart-documents"] = documents_figure(rows)  # {} without a documents mask
    models = [r for r in rows if r.workload == "model"]
    if models:
        figures["chart-components"] = components_figure(models)
        figures["chart-model-peak"] = model_peak_figure(models)
        figures["chart-step-time"] = step_time_figure(models)
    return {k: f for k, f in figures.items() if _drawn(f)}
