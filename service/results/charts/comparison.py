"""The compare page's chart: sweep B against sweep A, cell by cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.charts.common import chart_layout, empty_chart, to_json

CHANGE_COLOURS = {"slower": "#d62728", "faster": "#2ca02c", None: "#8c8c8c"}


def compare_figure(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s ratio B/A per matching cell with its interval (both runs' median intervals) as
    an error bar, coloured by that metric alone: red where B is slower and green where it is
    faster beyond both runs' noise, grey within the noise."""
    with_ratio = [p for p in pairs if p.get("tps_ratio") is not None]
    fig = go.Figure(
        layout=chart_layout(
            "Throughput ratio B / A per matching cell, with its interval<br><sup>red: slower, "
            "green: faster, beyond both medians' intervals at 95% or more; grey: neither, or "
            "too few iterations to tell</sup>",
            "tokens/s B / A (ratio)",
            "",
            xaxis={"title": {"text": "tokens/s B / A (ratio)"}, "rangemode": "tozero"},
            yaxis={"automargin": True, "autorange": "reversed"},
            height=max(320, 140 + 32 * len(with_ratio)),
            margin={"l": 70, "r": 20, "t": 80, "b": 60},
        )
    )
    if not with_ratio:
        return empty_chart(fig, "No matching cells with a throughput in both sweeps")
    ratios = [p["tps_ratio"] for p in with_ratio]
    top = max([*ratios, *(p.get("tps_hi") or 0 for p in with_ratio), 1.0])
    fig.update_xaxes(range=[0, top * 1.1])  # from 0: 0.31 against 0.98 reads as 1:3
    fig.add_shape(  # parity: B as fast as A
        type="line", x0=1, x1=1, xref="x", y0=0, y1=1, yref="paper",
        line={"color": "#333", "width": 1.5, "dash": "dash"},
    )  # fmt: skip
    fig.add_trace(
        go.Bar(
            y=[p["label"] for p in with_ratio],
            x=ratios,
            orientation="h",
            marker={"color": [CHANGE_COLOURS[p["time_change"]] for p in with_ratio]},
            error_x={
                "type": "data",
                "symmetric": False,
                "array": [
                    None if p.get("tps_hi") is None else p["tps_hi"] - r
                    for p, r in zip(with_ratio, ratios, strict=True)
                ],
                "arrayminus": [
                    None if p.get("tps_lo") is None else r - p["tps_lo"]
                    for p, r in zip(with_ratio, ratios, strict=True)
                ],
            },
            name="tokens/s B / A",
            hovertemplate="%{y}<br>%{x:.3f}<extra></extra>",
        )
    )
    return to_json(fig)
