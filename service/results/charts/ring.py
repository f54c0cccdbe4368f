"""Where a sequence-parallel sweep's time goes, for whoever tunes the ring: the exposed
communication share against tokens per rank (with each series' F/B crossover), and the
sequence-parallel schemes side by side.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.charts.common import (
    Row,
    Styles,
    empty_chart,
    grouped,
    log_x_layout,
    measured,
    succeeded,
    to_json,
)
from service.results.charts.performance import throughput_layout, throughput_line
from service.results.rows import local_tokens
from service.results.schemes import SCHEMES as SP_SCHEMES
from service.units import natural_key


def exposed_comm_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Exposed-communication share against tokens per rank, one line per ring variant and
    world size (coloured as in the sweep's other charts); each series' F/B crossover (tokens
    per rank) marked by a dashed line of its colour, inside the plot (crossover_range)."""
    styles = styles or Styles(rows)
    fig = go.Figure(
        layout=log_x_layout(
            "Exposed communication",
            "tokens per rank (tokens)",
            "blocked on transfers (% of step time)",
            tickformat=".0%",
        )
    )
    ok = succeeded(rows, "exposed_comm_share")
    if not ok:
        return empty_chart(fig, "No ring run has stored its steps yet")
    xs: list[float] = []
    for name, group in grouped(ok).items():
        tokens = [local_tokens(r.parallel, r.world_size, r.batch_size, r.length) for r in group]
        xs += tokens
        fig.add_trace(
            go.Scatter(
                x=tokens,
                y=[r.exposed_comm_share for r in group],
                mode="lines+markers",
                name=name,
                line=styles.line(group[0]),
                marker=styles.marker(group[0]),
                hovertemplate="%{x:,} tokens per rank: %{y:.1%} blocked<extra>" + name + "</extra>",
            )
        )
        crossings = sorted(r.crossover_tokens for r in group if r.crossover_tokens)
        if crossings:  # a vertical line as a trace: named in the legend, on the log axis
            at = crossings[len(crossings) // 2]
            xs.append(at)
            basis = next(r.crossover_basis for r in group if r.crossover_tokens)
            top = max(measured(r.exposed_comm_share) for r in ok) or 1.0
            fig.add_trace(
                go.Scatter(
                    x=[at, at],
                    y=[0, top],
                    mode="lines",
                    line={"dash": "dash", "color": styles.line(group[0])["color"], "width": 2},
                    name=f"F/B crossover {at:,.0f} tokens ({basis}): {name}",
                    hoverinfo="name",
                )
            )
    fig.update_xaxes(range=crossover_range(xs))
    return to_json(fig)


def crossover_range(xs: Sequence[float]) -> list[float]:
    """A log axis's range (log10 ends) around every x, padded by 8% of its span (at least
    0.1 decade) each side: a crossover line at the smallest or largest x stands clear of the
    axis instead of lying on it."""
    lo, hi = math.log10(min(xs)), math.log10(max(xs))
    pad = max(0.1, 0.08 * (hi - lo))
    return [lo - pad, hi + pad]


def sp_schemes_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """The sequence-parallel schemes side by side (report.md's section as one chart): tokens/s
    against length, one line per scheme (and mode and world size when several ran), log-log;
    drawn only when two or more schemes ran timed on several ranks (else no data)."""
    ok = [
        r
        for r in succeeded(rows, "tokens_per_s")
        if r.kernel in SP_SCHEMES and (r.world_size or 1) > 1 and not r.searched
    ]
    if len({r.kernel for r in ok}) < 2:
        return {}
    styles = styles or Styles(rows)
    fig = go.Figure(layout=throughput_layout("Sequence-parallel schemes", ok))
    several = {(r.mode, r.world_size) for r in ok}
    lines: dict[str, list[Row]] = defaultdict(list)
    for r in ok:
        extra = f" ({r.mode}, W={r.world_size})" if len(several) > 1 else ""
        lines[r.scheme + extra].append(r)
    for name in sorted(lines, key=natural_key):
        group = sorted(lines[name], key=lambda r: r.length)
        fig.add_trace(throughput_line(name, group, styles, hover_name=True))
    return to_json(fig)
