"""Chart builders: result rows (service.results.rows.RunRow.as_dict) in, Plotly figure JSON out.

Pure functions, so they are unit-tested on rows without a server. An empty chart says why it is
empty; no number is drawn that was not measured (the memory floor is computed from the shape).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.rows import local_tokens, memory_floor
from service.results.schemes import SCHEMES as SP_SCHEMES
from service.units import natural_key

Row = dict[str, Any]

PROBE_STYLE = {
    "fit": {"color": "#2ca02c", "symbol": "circle"},
    "oom": {"color": "#d62728", "symbol": "x"},
    "error": {"color": "#ff7f0e", "symbol": "diamond"},
}


def _to_json(fig: go.Figure) -> dict[str, Any]:
    """The figure's JSON; a chart whose legend runs long grows taller rather than squeezing
    its plot (the legend sits below the axis title, in the container's own space)."""
    out = json.loads(fig.to_json())
    layout = out.setdefault("layout", {})
    named = [t for t in out.get("data", []) if t.get("showlegend", True) and t.get("name")]
    if "height" not in layout and out.get("data"):
        layout["height"] = 400 + 20 * max(0, len(named) - 4)
    return out


def _layout(title: str, x: str, y: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": x}},
        "yaxis": {"title": {"text": y}},
        "margin": {"l": 70, "r": 20, "t": 50, "b": 60},
        "legend": {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom"},
        "template": "plotly_white",
        **extra,
    }


def _log_x_layout(title: str, x: str, y: str, **y_extra: Any) -> dict[str, Any]:
    """A layout with a log x axis and a y axis from zero (y_extra: more of the y axis)."""
    return _layout(
        title,
        x,
        y,
        xaxis={"type": "log", "title": {"text": x}},
        yaxis={"title": {"text": y}, **y_extra, "rangemode": "tozero"},
    )


def _empty(fig: go.Figure, message: str) -> dict[str, Any]:
    """The figure with its axes hidden and `message` in the middle: says why it is empty."""
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(
        text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5, font={"size": 14}
    )
    return _to_json(fig)


def _succeeded(rows: Iterable[Row], metric: str) -> list[Row]:
    return [r for r in rows if r["status"] == "succeeded" and r.get(metric) is not None]


def _grouped(rows: Sequence[Row], with_world: bool = True) -> dict[str, list[Row]]:
    """Rows by legend label (the row's label, or its series label without the world size),
    the labels in numeric order."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r["label"] if with_world else r["series"]].append(r)
    ordered = sorted(groups.items(), key=lambda kv: natural_key(kv[0]))
    return {k: sorted(v, key=lambda r: r["length"]) for k, v in ordered}


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
        series = sorted({(r["kernel"], r["label"]) for r in rows},
                        key=lambda kl: (kl[0], natural_key(kl[1])))  # fmt: skip
        modes = sorted({str(r.get("mode")) for r in rows})
        shapes = sorted({_shape(r) for r in rows}, key=natural_key)
        self.series = {label: PALETTE[i % len(PALETTE)] for i, (_, label) in enumerate(series)}
        self.colour: dict[str, str] = {}
        for kernel, label in series:
            self.colour.setdefault(kernel, self.series[label])
        self.dash = {m: DASHES[i % len(DASHES)] for i, m in enumerate(modes)}
        self.symbol = {s: SYMBOLS[i % len(SYMBOLS)] for i, s in enumerate(shapes)}

    def _of(self, r: Row) -> str:
        return self.series.get(r["label"]) or self.colour[r["kernel"]]

    def line(self, r: Row, by_kernel: bool = False) -> dict[str, Any]:
        """A line's style: its series' colour (its kernel's with by_kernel), its mode's dash."""
        colour = self.colour[r["kernel"]] if by_kernel else self._of(r)
        return {"color": colour, "dash": self.dash[str(r.get("mode"))]}

    def marker(self, r: Row, by_kernel: bool = False) -> dict[str, Any]:
        colour = self.colour[r["kernel"]] if by_kernel else self._of(r)
        return {"color": colour, "symbol": self.symbol[_shape(r)], "size": 8}


def _shape(r: Row) -> str:
    """How a run is spread: "W=1", "W=2 data", "W=2 sequence"."""
    w = r.get("world_size") or 1
    return f"W={w}" if w == 1 else f"W={w} {r.get('parallel')}"


def tokens_text(n: int) -> str:
    """A length as an axis tick: 1,024 -> "1K", 1,536 -> "1.5K", 1,048,576 -> "1M"."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= size and (n * 2) % size == 0:
            return f"{n / size:g}{suffix}"
    return f"{n:,}"


def length_axis(lengths: Iterable[int], title: str = "sequence length (tokens)") -> Row:
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


def log_axis(values: Iterable[float], title: str, text: Any = si_text) -> Row:
    """A log axis ticked at 1, 2 and 5 times the powers of ten around the values, every label
    a whole number ("20M", not a lone "2" beside "10M")."""
    seen = [v for v in values if v and v > 0]
    axis: Row = {"type": "log", "title": {"text": title}}
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


def bytes_unit(values: Iterable[float]) -> tuple[str, float]:
    """The binary unit of a memory axis: GiB when its largest value reaches 1 GiB, else MiB
    (KiB below 1 MiB)."""
    top = max(values, default=0)
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if top >= size:
            return name, float(size)
    return "KiB", 1024.0


def throughput_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Tokens/s vs sequence length, one line per kernel variant and world size, log-log."""
    ok = _succeeded(rows, "tokens_per_s")
    styles = styles or Styles(rows)
    fig = go.Figure(layout=_throughput_layout("Throughput", ok))
    if not ok:
        return _empty(fig, "No succeeded runs with a measured time yet")
    for name, group in _grouped(ok).items():
        fig.add_trace(_throughput_line(name, group, styles))
    return _to_json(fig)


def _throughput_layout(title: str, rows: Sequence[Row]) -> dict[str, Any]:
    """Tokens/s against length, both on log axes fitted to `rows`."""
    return _layout(
        title,
        "sequence length (tokens)",
        "throughput (tokens/s)",
        xaxis=length_axis(r["length"] for r in rows),
        yaxis=log_axis((r["tokens_per_s"] for r in rows), "throughput (tokens/s)"),
    )


def _throughput_line(
    name: str, group: Sequence[Row], styles: Styles, hover_name: bool = False
) -> go.Scatter:
    """One line of tokens/s against length, its run in the hover (and its name, hover_name);
    coloured as its series, or as its kernel when it joins several series."""
    by_kernel = len({r["label"] for r in group}) > 1
    return go.Scatter(
        x=[r["length"] for r in group],
        y=[r["tokens_per_s"] for r in group],
        mode="lines+markers",
        name=name,
        line=styles.line(group[0], by_kernel),
        marker=styles.marker(group[0], by_kernel),
        customdata=[r["run_id"] for r in group],
        hovertemplate="seq %{x}<br>%{y:.4s} tokens/s<br>run %{customdata}<extra>"
        + (name if hover_name else "")
        + "</extra>",
    )


def memory_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Peak memory per rank vs sequence length in MiB or GiB, with each distinct forward
    memory floor drawn once as a grey dashed line."""
    ok = _succeeded(rows, "peak_memory_bytes")
    probed = probe_memory_points(rows)
    styles = styles or Styles(rows)
    floor_rows = list(ok) + [
        {**r, "length": p["seq_len"]}
        for r in rows
        for p in r["probes"]
        if p["outcome"] == "fit" and p["peak_memory_bytes"] is not None
    ]
    floors = floor_lines(floor_rows)
    values = [r["peak_memory_bytes"] for r in ok]
    values += [y for points, _ in probed.values() for _, y in points]
    unit, size = bytes_unit(values + [y for line in floors.values() for _, y in line])
    lengths = [r["length"] for r in floor_rows]
    fig = go.Figure(
        layout=_layout(
            "Peak memory per rank",
            "sequence length (tokens)",
            f"peak memory per rank ({unit})",
            xaxis=length_axis(lengths),
            yaxis=log_axis(
                [v / size for v in values + [y for line in floors.values() for _, y in line]],
                f"peak memory per rank ({unit})",
                lambda v: f"{v:g}",
            ),
        )
    )
    if not ok and not probed:
        return _empty(fig, "No succeeded runs or probes with a measured peak memory yet")
    hover = "seq %{x}<br>%{y:.1f} " + unit
    for name, group in _grouped(ok).items():
        fig.add_trace(
            go.Scatter(
                x=[r["length"] for r in group],
                y=[r["peak_memory_bytes"] / size for r in group],
                mode="lines+markers",
                name=name,
                line=styles.line(group[0]),
                marker=styles.marker(group[0]),
                customdata=[r["run_id"] for r in group],
                hovertemplate=hover + "<br>run %{customdata}<extra></extra>",
            )
        )
    for name, (points, run_id) in probed.items():
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in points],
                y=[y / size for _, y in points],
                mode="lines+markers",
                name=f"{name} (probes that fit)",
                hovertemplate=hover + f"<br>run {run_id}<extra></extra>",
            )
        )
    _add_floors(fig, floors, unit, size)
    return _to_json(fig)


def _add_floors(
    fig: go.Figure, floors: dict[str, list[tuple[int, int]]], unit: str, size: float
) -> None:
    """Each distinct floor as a thin grey line, told apart by its dash."""
    for i, (name, line) in enumerate(floors.items()):
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in line],
                y=[y / size for _, y in line],
                mode="lines",
                name=name,
                line={"dash": DASHES[1 + i % (len(DASHES) - 1)], "color": "#777", "width": 1.5},
                hovertemplate="seq %{x}<br>floor %{y:.1f} " + unit + "<extra></extra>",
            )
        )


def probe_memory_points(rows: Sequence[Row]) -> dict[str, tuple[list[tuple[int, int]], int]]:
    """Peak memory of every probe that fit, (seq_len, bytes) per searched run, by legend label."""
    out: dict[str, tuple[list[tuple[int, int]], int]] = {}
    for r in sorted((r for r in rows if r["probes"]), key=lambda r: r["run_id"]):
        points = sorted(
            (p["seq_len"], p["peak_memory_bytes"])
            for p in r["probes"]
            if p["outcome"] == "fit" and p["peak_memory_bytes"] is not None
        )
        if points:
            out[r["label"]] = (points, r["run_id"])
    return out


FLOOR_PARTS = ("h", "kv", "d", "dtype", "W", "parallel", "b")


def floor_lines(rows: Sequence[Row]) -> dict[str, list[tuple[int, int]]]:
    """The forward floor per rank, (length, bytes) points, once per distinct floor (shapes
    whose floors coincide share one line), named by only what differs between the floors:
    "memory floor" alone, else "floor W=2", "floor d=64 W=1"."""
    keyed: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for r in rows:
        if r.get("workload") == "model":
            continue  # q, k, v, out and lse are no floor of a whole model's training step
        key = (r["num_heads"], r["num_kv_heads"], r["head_dim"], r["dtype"], r["world_size"])
        keyed[(*key, r["parallel"], r["batch_size"])].add(r["length"])
    distinct: dict[tuple[tuple[int, int], ...], tuple[Any, ...]] = {}
    for (h, kv, d, dtype, w, parallel, batch), lengths in sorted(keyed.items(), key=str):
        points = []
        for s in sorted(lengths):
            floor = memory_floor(dtype, h, d, local_tokens(parallel, w, batch, s), kv)
            if floor is not None:
                points.append((s, floor))
        if points:
            distinct.setdefault(tuple(points), (h, kv, d, dtype, w, parallel, batch))
    if len(distinct) == 1:
        return {"memory floor": list(next(iter(distinct)))}
    varies = [i for i in range(len(FLOOR_PARTS)) if len({k[i] for k in distinct.values()}) > 1]
    lines: dict[str, list[tuple[int, int]]] = {}
    for shared, key in distinct.items():
        parts = [_floor_part(FLOOR_PARTS[i], key[i]) for i in varies]
        name = "floor " + " ".join(p for p in parts if p) if any(parts) else "memory floor"
        lines.setdefault(name, list(shared))
    return dict(sorted(lines.items(), key=lambda kv: natural_key(kv[0])))


def _floor_part(name: str, value: Any) -> str:
    if name == "parallel":
        return "data" if value == "data" else ""
    if name == "dtype":
        return str(value)
    return f"{name}={value}"


def max_len_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Largest length that fit per run (horizontal bars: long labels stay readable), every probe
    as a marker on the same row."""
    searched = sorted((r for r in rows if r["probes"]), key=lambda r: (r["label"], r["run_id"]))
    fig = go.Figure(
        layout=_layout(
            "Maximum sequence length",
            "sequence length (tokens)",
            "",
            xaxis={"type": "log", "title": {"text": "sequence length (tokens)"}},
            yaxis={"automargin": True, "autorange": "reversed"},
            barmode="overlay",
            height=max(360, 180 + 56 * len(searched)),
        )
    )
    if not searched:
        return _empty(fig, "No maximum-length searches in this sweep")
    fig.update_xaxes(**_probed_axis(searched))
    cats = [wrapped(r["label"]) for r in searched]
    best = [r["max_seq_len"] for r in searched]
    probe_pts: dict[str, tuple[list[str], list[int], list[str]]] = {
        k: ([], [], []) for k in PROBE_STYLE
    }
    for cat, r in zip(cats, searched, strict=True):
        for p in r["probes"]:
            xs, ys, texts = probe_pts.setdefault(p["outcome"], ([], [], []))
            xs.append(cat)
            ys.append(p["seq_len"])
            texts.append(p["outcome"] + (" (emulated budget)" if p.get("emulated") else ""))
    fig.add_trace(
        go.Bar(
            y=cats,
            x=best,
            orientation="h",
            name="max length that fit",
            marker={"color": "#9ecae1"},
            text=[f"{b:,}" if b else "none fit" for b in best],
            textposition="inside",
            insidetextanchor="end",
        )
    )
    for outcome, (cs, lengths, texts) in probe_pts.items():
        if not cs:
            continue
        style = PROBE_STYLE.get(outcome, {"color": "#333", "symbol": "square"})
        fig.add_trace(
            go.Scatter(
                y=cs,
                x=lengths,
                mode="markers",
                name=f"probe: {outcome}",
                marker={"color": style["color"], "symbol": style["symbol"], "size": 10},
                text=texts,
                hovertemplate="%{y}<br>probe %{x:,}: %{text}<extra></extra>",
            )
        )
    return _to_json(fig)


def _probed_axis(searched: Sequence[Row]) -> Row:
    """A length axis from just below the shortest probe to just above the longest."""
    lengths = [p["seq_len"] for r in searched for p in r["probes"]]
    lengths += [r["max_seq_len"] for r in searched if r["max_seq_len"]]
    axis = length_axis(lengths, "sequence length (tokens)")
    axis["range"] = [math.log10(min(lengths) / 1.5), math.log10(max(lengths) * 1.5)]
    return axis


def _scaling_name(r: Row, base: Row) -> str:
    name = f"{r['series']} · seq {r['length']:,}"
    if base["kernel"] != r["kernel"]:
        name += f" (vs {base['kernel']} W={base['world_size']})"
    return name


def scaling_points(rows: Sequence[Row]) -> dict[str, list[tuple[int, float]]]:
    """Scaling efficiency (service.results.baselines) per series and length: (world size,
    efficiency), starting at the baseline's world size with 1.0."""
    by_id = {r["run_id"]: r for r in rows}
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in _succeeded(rows, "efficiency"):
        base = by_id[r["baseline_run_id"]]
        name = _scaling_name(r, base)
        if not series[name]:
            series[name].append((base["world_size"], 1.0))
        series[name].append((r["world_size"], r["efficiency"]))
    ordered = sorted(series.items(), key=lambda kv: natural_key(kv[0]))
    return {name: sorted(set(line)) for name, line in ordered}


def scaling_noise(rows: Sequence[Row]) -> dict[tuple[str, int], tuple[float, float, str]]:
    """(series, world size) -> (efficiency_lo, efficiency_hi, the flags' sentences) of each
    point of scaling_points that has an interval or a flag (the baseline's 1.0 has neither)."""
    by_id = {r["run_id"]: r for r in rows}
    out = {}
    for r in _succeeded(rows, "efficiency"):
        name = _scaling_name(r, by_id[r["baseline_run_id"]])
        lo, hi = r.get("efficiency_lo"), r.get("efficiency_hi")
        flags = " ".join(f["text"] for f in r.get("flags") or [] if f["field"] == "efficiency")
        if (lo is not None and hi is not None) or flags:
            eff = r["efficiency"]
            out[(name, r["world_size"])] = (eff if lo is None else lo, eff if hi is None else hi,
                                            flags)  # fmt: skip
    return out


def scaling_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Scaling efficiency vs world size (1.0 = linear), for configs measured at W=1 and beyond,
    each point with its interval (both runs' noise) as an error bar; a point above 100% beyond
    the noise (flagged) is drawn as a red cross, its reason in the hover."""
    fig = go.Figure(
        layout=_log_x_layout(
            "Scaling efficiency (bars: interval from both runs' noise; ✕: above 100%, flagged)",
            "world size (ranks)",
            "scaling efficiency (fraction of linear)",
        )
    )
    points = scaling_points(rows)
    if not points:
        return _empty(fig, "Scaling needs the same config measured at world size 1 and above")
    noise = scaling_noise(rows)
    worlds = sorted({w for line in points.values() for w, _ in line} | {1})
    fig.update_xaxes(tickvals=worlds, ticktext=[str(w) for w in worlds])
    fig.add_trace(
        go.Scatter(
            x=worlds,
            y=[1.0] * len(worlds),
            mode="lines",
            name="linear",
            line={"dash": "dot", "color": "#888"},
        )
    )
    for name, line in points.items():
        fig.add_trace(_scaling_line(name, line, noise))
    flagged = [(name, w, e, noise[(name, w)][2]) for name, line in points.items()
               for w, e in line if noise.get((name, w), (0, 0, ""))[2]]  # fmt: skip
    if flagged:
        fig.add_trace(
            go.Scatter(
                x=[w for _, w, _, _ in flagged],
                y=[e for _, _, e, _ in flagged],
                mode="markers",
                name="above 100% (flagged)",
                marker={"symbol": "x", "color": "#d62728", "size": 14},
                text=[f"{name}: {text}" for name, _, _, text in flagged],
                hovertemplate="W=%{x}<br>efficiency %{y:.2f}<br>%{text}<extra></extra>",
            )
        )
    return _to_json(fig)


def _scaling_line(
    name: str,
    line: Sequence[tuple[int, float]],
    noise: dict[tuple[str, int], tuple[float, float, str]],
) -> go.Scatter:
    """One config's efficiency against world size, each point's interval as its error bar."""
    spans = [noise.get((name, w), (e, e, "")) for w, e in line]
    return go.Scatter(
        x=[w for w, _ in line],
        y=[e for _, e in line],
        mode="lines+markers",
        name=name,
        error_y={
            "type": "data",
            "symmetric": False,
            "array": [hi - e for (_, e), (_, hi, _) in zip(line, spans, strict=True)],
            "arrayminus": [e - lo for (_, e), (lo, _, _) in zip(line, spans, strict=True)],
        },
        hovertemplate="W=%{x}<br>efficiency %{y:.2f}<extra></extra>",
    )


def peak_fraction_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Achieved FLOP/s per rank as a fraction of the device's dense peak, when it is known."""
    styles = styles or Styles(rows)
    fig = go.Figure(
        layout=_layout(
            "Fraction of dense peak",
            "sequence length (tokens)",
            "achieved / dense peak FLOP/s (fraction)",
            xaxis=length_axis(r["length"] for r in _succeeded(rows, "flops_per_s_per_rank")),
            yaxis={
                "title": {"text": "achieved / dense peak FLOP/s (fraction)"},
                "rangemode": "tozero",
            },
        )
    )
    ok = _succeeded(rows, "flops_per_s_per_rank")
    if not ok:
        return _empty(fig, "No succeeded runs with measured FLOP/s yet")
    known = [r for r in ok if r["peak_fraction"] is not None]
    unknown = {
        f"{r['device'] or 'unrecorded device'} ({r['dtype']})"
        for r in ok
        if r["peak_fraction"] is None
    }
    for name, group in _grouped(known).items():
        fig.add_trace(
            go.Scatter(
                x=[r["length"] for r in group],
                y=[r["peak_fraction"] for r in group],
                mode="lines+markers",
                name=f"{name} · {group[0]['device']}",
                line=styles.line(group[0]),
                marker=styles.marker(group[0]),
                customdata=[r["flops_per_s_per_rank"] / 1e12 for r in group],
                hovertemplate="seq %{x}<br>%{y:.1%} of peak (%{customdata:.2f} TFLOP/s)"
                "<extra></extra>",
            )
        )
    if unknown:
        note = "no reference peak for " + ", ".join(sorted(unknown))
        note += " (achieved TFLOP/s is in the table)"
        if not known:
            return _empty(fig, note)
        fig.add_annotation(
            text=note, showarrow=False, xref="paper", yref="paper", x=0, y=1.08, xanchor="left"
        )
    return _to_json(fig)


CHANGE_COLOURS = {"slower": "#d62728", "faster": "#2ca02c", None: "#8c8c8c"}


def compare_figure(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s ratio B/A per matching cell with its interval (both runs' median intervals) as
    an error bar, coloured by that metric alone: red where B is slower and green where it is
    faster beyond both runs' noise, grey within the noise."""
    with_ratio = [p for p in pairs if p.get("tps_ratio") is not None]
    fig = go.Figure(
        layout=_layout(
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
        return _empty(fig, "No matching cells with a throughput in both sweeps")
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
    return _to_json(fig)


SCALING_MIN_WORLD_SIZES = 3
"""Fewer distinct world sizes than this: the scaling efficiency is a table, not a chart."""


def world_sizes(rows: Sequence[Row]) -> list[int]:
    return sorted({r["world_size"] for r in rows})


def scaling_table(rows: Sequence[Row]) -> dict[str, Any] | None:
    """The scaling efficiency as a table where a chart would have two x values: a row per
    series and length, a column per world size, each cell with its interval and a flag's
    sentence (None when there is nothing to show or when the chart shows it)."""
    points = scaling_points(rows)
    worlds = sorted({w for line in points.values() for w, _ in line})
    if not points or len(world_sizes(rows)) >= SCALING_MIN_WORLD_SIZES:
        return None
    noise = scaling_noise(rows)
    body = []
    for name, line in points.items():
        values = dict(line)
        cells = []
        for w in worlds:
            e = values.get(w)
            lo, hi, flag = noise.get((name, w), (e, e, ""))
            text = "—" if e is None else f"{e:.2f}"
            if e is not None and lo is not None and hi is not None and lo != hi:
                text += f" ({lo:.2f}-{hi:.2f})"
            cells.append({"text": text, "flag": flag})
        body.append([name, cells])
    return {"worlds": worlds, "rows": body}


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
    if any(r.get("peak_fraction") is not None for r in rows):
        figures["chart-peak"] = peak_fraction_figure(rows, styles)
    if any(r.get("exposed_comm_share") is not None for r in rows):
        figures["chart-comm"] = exposed_comm_figure(rows, styles)
    schemes = sp_schemes_figure(rows, styles)
    if _points(schemes) != _points(figures["chart-throughput"]):  # else the same chart twice
        figures["chart-sp-schemes"] = schemes
    models = [r for r in rows if r.get("workload") == "model"]
    if models:
        figures["chart-components"] = components_figure(models)
        figures["chart-model-peak"] = model_peak_figure(models)
        figures["chart-step-time"] = step_time_figure(models)
    return {k: f for k, f in figures.items() if _drawn(f)}


# ---------------------------------------------------------------- training memory (seed 004)

STACKED_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations")
COMPONENT_COLOURS = {
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_states": "#2ca02c",
    "activations": "#9467bd",
    "transient": "#8c564b",
}
PHASE_COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e", "optimizer": "#2ca02c"}
GIB = float(1 << 30)


def _component_values(row: Row, key: str) -> dict[str, float | None]:
    """Stacked segments in GiB: parameters, gradients, optimizer states, activations, then
    the rest of the step peak (transients), from `key` (measured_bytes / predicted_bytes)."""
    by_name = {c["component"]: c.get(key) for c in row.get("components") or []}
    values: dict[str, float | None] = {}
    for name in STACKED_COMPONENTS:
        v = by_name.get(name)
        values[name] = None if v is None else v / GIB
    peak = by_name.get("step_peak")
    parts = [v for v in values.values() if v is not None]
    values["transient"] = None if peak is None else max(peak / GIB - sum(parts), 0.0)
    return values


def _run_labels(rows: Sequence[Row]) -> list[str]:
    return [f"{r['label']} @ {r['length']:,}" for r in rows]


def _bar_layout(title: str, x: str, n: int, **extra: Any) -> dict[str, Any]:
    """Horizontal bars, one row per run: long labels stay readable at the left."""
    return _layout(
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
    stored = [r for r in rows if r.get("components")]
    fig = go.Figure(
        layout=_bar_layout(
            "Memory per component (predicted outlined)",
            "memory per rank (GiB)",
            len(stored),
            barmode="overlay",
        )
    )
    if not stored:
        return _empty(fig, "No model run has stored its memory components yet")
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
                    hovertemplate="%{y}<br>" + f"{name} {side}: " + "%{x:.3f} GiB<extra></extra>",
                )
            )
            bottoms = [b + w for b, w in zip(bottoms, widths, strict=True)]
    return _to_json(fig)


def model_peak_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Step peak memory vs length for each model series: measured points (a search's probes,
    or the runs), the predicted step peak as a dashed line through the same lengths, and the
    memory budget where one is set."""
    fig = go.Figure(
        layout=_layout(
            "Step peak vs length (predicted dashed)",
            "sequence length (tokens)",
            "step peak per rank (GiB)",
        )
    )
    drawn = False
    for name, group in _grouped([r for r in rows if r["status"] != "queued"], False).items():
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
        b
        for r in rows
        for rank in r.get("ranks") or []
        if (b := rank.get("memory_budget_bytes")) is not None
    }
    for budget in sorted(budgets):
        fig.add_hline(
            y=budget / GIB,
            line={"dash": "dot", "color": "#d62728"},
            annotation_text=f"budget {budget / GIB:.2f} GiB",
        )
    if not drawn:
        return _empty(fig, "No model run has measured a step peak yet")
    return _to_json(fig)


def _peak_points(group: Sequence[Row]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """A model series' (length, GiB) step peaks, measured (a search's probes, else the runs)
    and predicted (every length the cell was predicted at), each sorted by length."""
    measured: list[tuple[int, float]] = []
    predicted: list[tuple[int, float]] = []
    for r in group:
        for p in r.get("probes") or []:
            if p.get("peak_memory_bytes") is not None:
                measured.append((p["seq_len"], p["peak_memory_bytes"] / GIB))
        if not r.get("probes") and r.get("peak_memory_bytes") is not None:
            measured.append((r["length"], r["peak_memory_bytes"] / GIB))
        predicted += [(n, b / GIB) for n, b in r.get("predicted_peaks") or []]
        if not r.get("probes") and r.get("predicted_peak_bytes") is not None:
            predicted.append((r["length"], r["predicted_peak_bytes"] / GIB))
    return sorted(measured), sorted(set(predicted))


def step_time_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Each model run's step split into forward, backward and optimizer (slowest rank's
    medians): the step-time cost of checkpointing shows as the longer backward."""
    timed = [r for r in rows if r.get("forward_s") is not None]
    fig = go.Figure(
        layout=_bar_layout("Step time by phase", "time per step (s)", len(timed), barmode="stack")
    )
    if not timed:
        return _empty(fig, "No model run has measured a step yet")
    labels = _run_labels(timed)
    for phase in ("forward", "backward", "optimizer"):
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[r[f"{phase}_s"] for r in timed],
                orientation="h",
                name=phase,
                marker={"color": PHASE_COLOURS[phase]},
            )
        )
    return _to_json(fig)


def rank_times_figure(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every timed repeat of every rank (box per rank), to see stragglers and spread."""
    fig = go.Figure(layout=_layout("Timed repeats per rank", "rank (index)", "time (s)"))
    with_times = [r for r in ranks if r.get("times_s")]
    if not with_times:
        return _empty(fig, "No timed repeats recorded for this run")
    for r in with_times:
        fig.add_trace(go.Box(y=r["times_s"], name=f"rank {r['rank']}", boxpoints="all", jitter=0.3))
    fig.update_layout(showlegend=False)
    return _to_json(fig)


# ---------------------------------------------------------------- where the time goes (ring)

STEP_COLOURS = {"compute": "#1f77b4", "wait": "#d62728"}


def exposed_comm_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Exposed-communication share against tokens per rank, one line per ring variant and
    world size (coloured as in the sweep's other charts); each series' F/B crossover (tokens
    per rank) marked by a dashed line of its colour, inside the plot (crossover_range)."""
    styles = styles or Styles(rows)
    fig = go.Figure(
        layout=_log_x_layout(
            "Exposed communication",
            "tokens per rank (tokens)",
            "blocked on transfers (% of step time)",
            tickformat=".0%",
        )
    )
    ok = _succeeded(rows, "exposed_comm_share")
    if not ok:
        return _empty(fig, "No ring run has stored its steps yet")
    xs: list[float] = []
    for name, group in _grouped(ok).items():
        tokens = [
            local_tokens(r["parallel"], r["world_size"], r["batch_size"], r["length"])
            for r in group
        ]
        xs += tokens
        fig.add_trace(
            go.Scatter(
                x=tokens,
                y=[r["exposed_comm_share"] for r in group],
                mode="lines+markers",
                name=name,
                line=styles.line(group[0]),
                marker=styles.marker(group[0]),
                hovertemplate="%{x:,} tokens per rank: %{y:.1%} blocked<extra>" + name + "</extra>",
            )
        )
        crossings = sorted(r["crossover_tokens"] for r in group if r.get("crossover_tokens"))
        if crossings:  # a vertical line as a trace: named in the legend, on the log axis
            at = crossings[len(crossings) // 2]
            xs.append(at)
            basis = next(r["crossover_basis"] for r in group if r.get("crossover_tokens"))
            top = max(r["exposed_comm_share"] for r in ok) or 1.0
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
    return _to_json(fig)


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
        for r in _succeeded(rows, "tokens_per_s")
        if r["kernel"] in SP_SCHEMES and (r.get("world_size") or 1) > 1 and not r.get("searched")
    ]
    if len({r["kernel"] for r in ok}) < 2:
        return {}
    styles = styles or Styles(rows)
    fig = go.Figure(layout=_throughput_layout("Sequence-parallel schemes", ok))
    several = {(r.get("mode"), r["world_size"]) for r in ok}
    lines: dict[str, list[Row]] = defaultdict(list)
    for r in ok:
        extra = f" ({r.get('mode')}, W={r['world_size']})" if len(several) > 1 else ""
        lines[r["kernel"] + extra].append(r)
    for name in sorted(lines, key=natural_key):
        group = sorted(lines[name], key=lambda r: r["length"])
        fig.add_trace(_throughput_line(name, group, styles, hover_name=True))
    return _to_json(fig)


def _median_iteration(steps: Sequence[Row]) -> int:
    """The timed iteration whose slowest rank's step time is the median over iterations."""
    per: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for s in steps:
        per[s["iteration"]][s["rank"]] += s["compute_s"] + s["wait_s"]
    slowest = sorted((max(ranks.values()), it) for it, ranks in per.items())
    return slowest[(len(slowest) - 1) // 2][1]


def step_timeline_figure(steps: Sequence[Row]) -> dict[str, Any]:
    """One timed iteration (the median one) per rank: each ring step as its compute then its
    wait, in step order (forward, then backward), so a slow rank or a step whose transfer
    was not hidden stands out."""
    title = "Ring steps per rank (median iteration)"
    fig = go.Figure(layout=_layout(title, "time (s)", "rank (index)"))
    if not steps:
        return _empty(fig, "No ring steps recorded for this run")
    iteration = _median_iteration(steps)
    chosen = [s for s in steps if s["iteration"] == iteration]
    ranks = sorted({s["rank"] for s in chosen})
    bars: dict[str, dict[str, list[Any]]] = {
        k: {"y": [], "x": [], "base": [], "text": []} for k in STEP_COLOURS
    }
    for rank in ranks:
        t = 0.0
        mine = [s for s in chosen if s["rank"] == rank]
        mine.sort(key=lambda s: (s["phase"] != "forward", s["step"]))
        for s in mine:
            for kind in ("compute", "wait"):
                seconds = s[f"{kind}_s"]
                bar = bars[kind]
                bar["y"].append(f"rank {rank}")
                bar["x"].append(seconds)
                bar["base"].append(t)
                bar["text"].append(
                    f"{s['phase']} step {s['step']}: {kind} {seconds * 1e3:.2f} ms, "
                    f"{s['received_bytes']:,} bytes in"
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
    return _to_json(fig)
