"""The training-memory charts of a sweep with model cells (seed 004), for whoever sizes a
training run: memory per component (predicted against measured), the step peak against length
with the memory budget, and the step's time by phase. Memory in GiB throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.charts.common import Row, chart_layout, empty_chart, grouped, to_json
from service.units import GIB, nbytes

STACKED_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations")
COMPONENT_COLOURS = {
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_states": "#2ca02c",
    "activations": "#9467bd",
    "transient": "#8c564b",
}
PHASE_COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e", "optimizer": "#2ca02c"}


def _component_values(row: Row, key: str) -> dict[str, float | None]:
    """Stacked segments in GiB: parameters, gradients, optimizer states, activations, then
    the rest of the step peak (transients), from `key` (measured_bytes / predicted_bytes)."""
    by_name = {c.component: getattr(c, key) for c in row.components or []}
    values: dict[str, float | None] = {}
    for name in STACKED_COMPONENTS:
        v = by_name.get(name)
        values[name] = None if v is None else GIB.of(v)
    peak = by_name.get("step_peak")
    parts = [v for v in values.values() if v is not None]
    values["transient"] = None if peak is None else max(GIB.of(peak) - sum(parts), 0.0)
    return values


def _run_labels(rows: Sequence[Row]) -> list[str]:
    return [f"{r.label} @ {r.length:,}" for r in rows]


def _bar_layout(title: str, x: str, n: int, **extra: Any) -> dict[str, Any]:
    """Horizontal bars, one row per run: long labels stay readable at the left."""
    return chart_layout(
        title,
        x,
        "",
        yaxis={"automargin": True, "autorange": "reversed"},
        height=max(320, 160 + 44 * n),
        **extra,
    )


def components_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Each model run's step peak split into parameters, gradients, optimizer states,
    activations and the transient rest: measured (filled, upper bar) above predicted
    (outlined, lower bar), in GiB."""
    stored = [r for r in rows if r.components]
    fig = go.Figure(
        layout=_bar_layout(
            "Memory per component (predicted outlined)",
            f"memory per rank ({GIB.name})",
            len(stored),
            barmode="overlay",
        )
    )
    if not stored:
        return empty_chart(fig, "No model run has stored its memory components yet")
    labels = _run_labels(stored)
    for side, key, offset in (
        ("measured", "measured_bytes", -0.4),
        ("predicted", "predicted_bytes", 0.0),
    ):
        bottoms = [0.0] * len(stored)
        values = [_component_values(r, key) for r in stored]
        for name in (*STACKED_COMPONENTS, "transient"):
            widths = [v[name] or 0.0 for v in values]
            colour = COMPONENT_COLOURS[name]
            marker: dict[str, Any] = (
                {"color": colour}
                if side == "measured"
                else {"color": "rgba(0,0,0,0)", "line": {"color": colour, "width": 2}}
            )
            fig.add_trace(
                go.Bar(
                    y=labels,
                    x=widths,
                    base=list(bottoms),
                    orientation="h",
                    offset=offset,
                    width=0.4,
                    name=f"{name.replace('_', ' ')} ({side})",
                    legendgroup=name,
                    marker=marker,
                    hovertemplate="%{y}<br>"
                    + f"{name} {side}: %{{x:.3f}} {GIB.name}<extra></extra>",
                )
            )
            bottoms = [b + w for b, w in zip(bottoms, widths, strict=True)]
    return to_json(fig)


def model_peak_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Step peak memory vs length for each model series: measured points (a search's probes,
    or the runs), the predicted step peak as a dashed line through the same lengths, and the
    memory budget where one is set."""
    fig = go.Figure(
        layout=chart_layout(
            "Step peak vs length (predicted dashed)",
            "sequence length (tokens)",
            f"step peak per rank ({GIB.name})",
        )
    )
    drawn = False
    for name, group in grouped([r for r in rows if r.status != "queued"], False).items():
        measured, predicted = _peak_points(group)
        series: tuple[tuple[Any, str, dict[str, Any]], ...] = (
            (measured, "measured", {"mode": "markers"}),
            (predicted, "predicted", {"mode": "lines", "line": {"dash": "dash"}}),
        )
        for points, kind, style in series:
            if points:
                xs, ys = [p[0] for p in points], [p[1] for p in points]
                fig.add_trace(
                    go.Scatter(x=xs, y=ys, name=f"{name} {kind}", legendgroup=name, **style)
                )
        drawn = drawn or bool(measured or predicted)
    budgets = {
        b for r in rows for rank in r.ranks or [] if (b := rank.memory_budget_bytes) is not None
    }
    for budget in sorted(budgets):
        fig.add_hline(
            y=GIB.of(budget),
            line={"dash": "dot", "color": "#d62728"},
            annotation_text=f"budget {nbytes(budget, units=(GIB,))}",
        )
    if not drawn:
        return empty_chart(fig, "No model run has measured a step peak yet")
    return to_json(fig)


def _peak_points(group: Sequence[Row]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """A model series' (length, GiB) step peaks, measured (a search's probes, else the runs)
    and predicted (every length the cell was predicted at), each sorted by length."""
    measured: list[tuple[int, float]] = []
    predicted: list[tuple[int, float]] = []
    for r in group:
        for p in r.probes or []:
            if p.peak_memory_bytes is not None:
                measured.append((p.seq_len, GIB.of(p.peak_memory_bytes)))
        if not r.probes and r.peak_memory_bytes is not None:
            measured.append((r.length, GIB.of(r.peak_memory_bytes)))
        predicted += [(n, GIB.of(b)) for n, b in r.predicted_peaks or []]
        if not r.probes and r.predicted_peak_bytes is not None:
            predicted.append((r.length, GIB.of(r.predicted_peak_bytes)))
    return sorted(measured), sorted(set(predicted))


def step_time_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Each model run's step split into forward, backward and optimizer (slowest rank's
    medians): the step-time cost of checkpointing shows as the longer backward."""
    timed = [r for r in rows if r.forward_s is not None]
    fig = go.Figure(
        layout=_bar_layout("Step time by phase", "time per step (s)", len(timed), barmode="stack")
    )
    if not timed:
        return empty_chart(fig, "No model run has measured a step yet")
    labels = _run_labels(timed)
    for phase in ("forward", "backward", "optimizer"):
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[getattr(r, f"{phase}_s") for r in timed],
                orientation="h",
                name=phase,
                marker={"color": PHASE_COLOURS[phase]},
            )
        )
    return to_json(fig)
