"""What every chart shares: its layout, its empty state, the rows it draws (succeeded, grouped by
series), one style per series across a sweep's charts, and the axes (lengths, log scales).

Charts take the read model's rows (service.results.rows.RunRow), typed: a metric's name is an
attribute, so type checking sees it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import plotly.graph_objects as go

from service.results.rows import RunRow
from service.units import natural_key

Row = RunRow
"""A chart's row: one run of the read model."""
Axis = dict[str, Any]
"""A Plotly axis."""
Figure = TypeVar("Figure", int, float)


def measured(value: Figure | None) -> Figure:
    """A figure of a row that succeeded() kept for it: never None there (this says so to the
    type checker, and fails loudly if a chart draws a figure it did not filter its rows on)."""
    if value is None:
        raise ValueError("a chart drew a figure its rows were not filtered on")
    return value


def to_json(fig: go.Figure) -> dict[str, Any]:
    """The figure's JSON; a chart whose legend runs long grows taller rather than squeezing
    its plot (the legend sits below the axis title, in the container's own space)."""
    out = json.loads(fig.to_json())
    layout = out.setdefault("layout", {})
    named = [t for t in out.get("data", []) if t.get("showlegend", True) and t.get("name")]
    if "height" not in layout and out.get("data"):
        layout["height"] = 400 + 20 * max(0, len(named) - 4)
    return out


def chart_layout(title: str, x: str, y: str, **extra: Any) -> dict[str, Any]:
    """A chart's layout: its title and axis titles, the legend below the plot (extra: more of
    the layout, replacing these keys)."""
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": x}},
        "yaxis": {"title": {"text": y}},
        "margin": {"l": 70, "r": 20, "t": 50, "b": 60},
        "legend": {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom"},
        "template": "plotly_white",
        **extra,
    }


def log_x_layout(title: str, x: str, y: str, **y_extra: Any) -> dict[str, Any]:
    """A layout with a log x axis and a y axis from zero (y_extra: more of the y axis)."""
    return chart_layout(
        title,
        x,
        y,
        xaxis={"type": "log", "title": {"text": x}},
        yaxis=zero_y_axis(y, **y_extra),
    )


def zero_y_axis(y: str, **extra: Any) -> dict[str, Any]:
    """A y axis titled `y` that starts from zero (extra: more of the axis)."""
    return {"title": {"text": y}, **extra, "rangemode": "tozero"}


def empty_chart(fig: go.Figure, message: str) -> dict[str, Any]:
    """The figure with its axes hidden and `message` in the middle: says why it is empty."""
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(
        text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5, font={"size": 14}
    )
    return to_json(fig)


def succeeded(rows: Iterable[Row], metric: str) -> list[Row]:
    return [r for r in rows if r.status == "succeeded" and getattr(r, metric) is not None]


def grouped(rows: Sequence[Row], with_world: bool = True) -> dict[str, list[Row]]:
    """Rows by legend label (the row's label, or its series label without the world size),
    the labels in numeric order."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r.label if with_world else r.series].append(r)
    ordered = sorted(groups.items(), key=lambda kv: natural_key(kv[0]))
    return {k: sorted(v, key=lambda r: r.length) for k, v in ordered}


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#e6550d", "#31a354", "#843c39",
           "#7b4173", "#3182bd", "#636363", "#b5cf6b", "#ce6dbd", "#fd8d3c")  # fmt: skip
"""20 distinct colours: a chart with more series than this reuses them (its markers and dashes
still tell series apart)."""
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "x", "star", "pentagon")


class Styles:
    """One colour per series (a legend label: kernel and what else varies), one dash per mode,
    one marker per world size and parallel mode, the same in every chart of a sweep (built from
    all of its rows). A kernel's series take neighbouring colours and the kernel's own colour
    is its first series' one: a chart that draws one line per kernel (the sequence-parallel
    schemes) colours it as the other charts colour that kernel."""

    def __init__(self, rows: Sequence[Row]) -> None:
        series = sorted({(r.kernel, r.label) for r in rows},
                        key=lambda kl: (kl[0], natural_key(kl[1])))  # fmt: skip
        modes = sorted({str(r.mode) for r in rows})
        shapes = sorted({_shape(r) for r in rows}, key=natural_key)
        self.series = {label: PALETTE[i % len(PALETTE)] for i, (_, label) in enumerate(series)}
        self.colour: dict[str, str] = {}
        for kernel, label in series:
            self.colour.setdefault(kernel, self.series[label])
        self.dash = {m: DASHES[i % len(DASHES)] for i, m in enumerate(modes)}
        self.symbol = {s: SYMBOLS[i % len(SYMBOLS)] for i, s in enumerate(shapes)}

    def _of(self, r: Row) -> str:
        return self.series.get(r.label) or self.colour[r.kernel]

    def line(self, r: Row, by_kernel: bool = False) -> dict[str, Any]:
        """A line's style: its series' colour (its kernel's with by_kernel), its mode's dash."""
        colour = self.colour[r.kernel] if by_kernel else self._of(r)
        return {"color": colour, "dash": self.dash[str(r.mode)]}

    def marker(self, r: Row, by_kernel: bool = False) -> dict[str, Any]:
        colour = self.colour[r.kernel] if by_kernel else self._of(r)
        return {"color": colour, "symbol": self.symbol[_shape(r)], "size": 8}


def _shape(r: Row) -> str:
    """How a run is spread: "W=1", "W=2 data", "W=2 sequence"."""
    w = r.world_size or 1
    return f"W={w}" if w == 1 else f"W={w} {r.parallel}"


def tokens_text(n: int) -> str:
    """A length as an axis tick: 1,024 -> "1K", 1,536 -> "1.5K", 1,048,576 -> "1M"."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= size and (n * 2) % size == 0:
            return f"{n / size:g}{suffix}"
    return f"{n:,}"


def length_axis(lengths: Iterable[int], title: str = "sequence length (tokens)") -> Axis:
    """A log axis ticked at the measured lengths only, thinned so that no two ticks are closer
    than 1.4x (their labels would overlap)."""
    shown: list[int] = []
    for t in sorted(set(lengths)):
        if not shown or t >= shown[-1] * 1.4:
            shown.append(t)
    return {
        "type": "log",
        "title": {"text": title},
        "tickvals": shown,
        "ticktext": [tokens_text(t) for t in shown],
    }


def wrapped(label: str, width: int = 34) -> str:
    """A long label on several lines (at its " · " parts) for a bar chart's category axis."""
    lines: list[str] = []
    for part in label.split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " · " + part
        else:
            lines.append(part)
    return "<br>".join(lines)


def si_text(v: float) -> str:
    """A tick label with an SI prefix: 20000000 -> "20M"."""
    for size, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= size:
            return f"{v / size:g}{prefix}"
    return f"{v:g}"


def log_axis(values: Iterable[float], title: str, text: Any = si_text) -> Axis:
    """A log axis ticked at 1, 2 and 5 times the powers of ten around the values, every label
    a whole number ("20M", not a lone "2" beside "10M")."""
    seen = [v for v in values if v and v > 0]
    axis: Axis = {"type": "log", "title": {"text": title}}
    if not seen:
        return axis
    lo, hi = min(seen), max(seen)
    ticks = [
        m * 10.0**e
        for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
        for m in (1, 2, 5)
    ]
    inside = [t for t in ticks if lo / 1.3 <= t <= hi * 1.3]
    if len(inside) < 2:  # a narrow range: the nearest ticks either side
        inside = [max(t for t in ticks if t <= lo), min(t for t in ticks if t >= hi)]
    span = [min(lo, inside[0]), max(hi, inside[-1])]
    axis["range"] = [math.log10(span[0]) - 0.05, math.log10(span[1]) + 0.05]
    axis["tickvals"] = inside
    axis["ticktext"] = [text(t) for t in inside]
    return axis
