"""The run page's charts, for whoever looks into one run: every timed repeat of every rank, and
one timed iteration's ring steps per rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.charts.common import chart_layout, empty_chart, to_json
from service.results.stored import StoredRank, StoredStep


def rank_times_figure(ranks: Sequence[StoredRank]) -> dict[str, Any]:
    """Every timed repeat of every rank (box per rank), to see stragglers and spread."""
    fig = go.Figure(layout=chart_layout("Timed repeats per rank", "rank (index)", "time (s)"))
    with_times = [r for r in ranks if r.times_s]
    if not with_times:
        return empty_chart(fig, "No timed repeats recorded for this run")
    for r in with_times:
        fig.add_trace(go.Box(y=r.times_s, name=f"rank {r.rank}", boxpoints="all", jitter=0.3))
    fig.update_layout(showlegend=False)
    return to_json(fig)


STEP_COLOURS = {"compute": "#1f77b4", "wait": "#d62728"}


def _median_iteration(steps: Sequence[StoredStep]) -> int:
    """The timed iteration whose slowest rank's step time is the median over iterations."""
    per: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for s in steps:
        per[s.iteration][s.rank] += s.compute_s + s.wait_s
    slowest = sorted((max(ranks.values()), it) for it, ranks in per.items())
    return slowest[(len(slowest) - 1) // 2][1]


def step_timeline_figure(steps: Sequence[StoredStep]) -> dict[str, Any]:
    """One timed iteration (the median one) per rank: each ring step as its compute then its
    wait, in step order (forward, then backward), so a slow rank or a step whose transfer
    was not hidden stands out."""
    title = "Ring steps per rank (median iteration)"
    fig = go.Figure(layout=chart_layout(title, "time (s)", "rank (index)"))
    if not steps:
        return empty_chart(fig, "No ring steps recorded for this run")
    iteration = _median_iteration(steps)
    chosen = [s for s in steps if s.iteration == iteration]
    ranks = sorted({s.rank for s in chosen})
    bars: dict[str, dict[str, list[Any]]] = {
        k: {"y": [], "x": [], "base": [], "text": []} for k in STEP_COLOURS
    }
    for rank in ranks:
        t = 0.0
        mine = [s for s in chosen if s.rank == rank]
        mine.sort(key=lambda s: (s.phase != "forward", s.step))
        for s in mine:
            for kind in ("compute", "wait"):
                seconds = getattr(s, f"{kind}_s")
                bar = bars[kind]
                bar["y"].append(f"rank {rank}")
                bar["x"].append(seconds)
                bar["base"].append(t)
                bar["text"].append(
                    f"{s.phase} step {s.step}: {kind} {seconds * 1e3:.2f} ms, "
                    f"{s.received_bytes:,} bytes in"
                )
                t += seconds
    for kind, bar in bars.items():
        fig.add_trace(
            go.Bar(
                y=bar["y"],
                x=bar["x"],
                base=bar["base"],
                orientation="h",
                name=kind,
                marker={"color": STEP_COLOURS[kind], "line": {"color": "white", "width": 1}},
                hovertext=bar["text"],
                hoverinfo="text",
            )
        )
    title = f"Ring steps per rank (iteration {iteration}, the median)"
    fig.update_layout(barmode="overlay", title={"text": title})
    return to_json(fig)
