"""The sweep page's performance charts, for whoever reads a sweep's results: throughput, peak
memory (with its floor and the probes of a search), the maximum length a search found, scaling
efficiency (a chart, or a table below 3 world sizes) and the fraction of the dense peak.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.charts.common import (
    DASHES,
    Axis,
    Row,
    Styles,
    chart_layout,
    empty_chart,
    grouped,
    length_axis,
    log_axis,
    log_x_layout,
    measured,
    succeeded,
    to_json,
    wrapped,
    zero_y_axis,
)
from service.results.rows import local_tokens, memory_floor
from service.units import ByteUnit, byte_unit, natural_key

PROBE_STYLE = {
    "fit": {"color": "#2ca02c", "symbol": "circle"},
    "oom": {"color": "#d62728", "symbol": "x"},
    "error": {"color": "#ff7f0e", "symbol": "diamond"},
}


def throughput_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Tokens/s vs sequence length, one line per kernel variant and world size, log-log."""
    ok = succeeded(rows, "tokens_per_s")
    styles = styles or Styles(rows)
    fig = go.Figure(layout=throughput_layout("Throughput", ok))
    if not ok:
        return empty_chart(fig, "No succeeded runs with a measured time yet")
    for name, group in grouped(ok).items():
        fig.add_trace(throughput_line(name, group, styles))
    return to_json(fig)


def throughput_layout(title: str, rows: Sequence[Row]) -> dict[str, Any]:
    """Tokens/s against length, both on log axes fitted to `rows`."""
    return chart_layout(
        title,
        "sequence length (tokens)",
        "throughput (tokens/s)",
        xaxis=length_axis(r.length for r in rows),
        yaxis=log_axis((measured(r.tokens_per_s) for r in rows), "throughput (tokens/s)"),
    )


def throughput_line(
    name: str, group: Sequence[Row], styles: Styles, hover_name: bool = False
) -> go.Scatter:
    """One line of tokens/s against length, its run in the hover (and its name, hover_name);
    coloured as its series, or as its kernel when it joins several series."""
    by_kernel = len({r.label for r in group}) > 1
    return go.Scatter(
        x=[r.length for r in group],
        y=[r.tokens_per_s for r in group],
        mode="lines+markers",
        name=name,
        line=styles.line(group[0], by_kernel),
        marker=styles.marker(group[0], by_kernel),
        customdata=[r.run_id for r in group],
        hovertemplate="seq %{x}<br>%{y:.4s} tokens/s<br>run %{customdata}<extra>"
        + (name if hover_name else "")
        + "</extra>",
    )


def memory_figure(rows: Sequence[Row], styles: Styles | None = None) -> dict[str, Any]:
    """Peak memory per rank vs sequence length in MiB or GiB, with each distinct forward
    memory floor drawn once as a grey dashed line."""
    ok = succeeded(rows, "peak_memory_bytes")
    probed = probe_memory_points(rows)
    styles = styles or Styles(rows)
    floor_rows = [(r, r.length) for r in ok] + [
        (r, p.seq_len)
        for r in rows
        for p in r.probes
        if p.outcome == "fit" and p.peak_memory_bytes is not None
    ]
    floors = floor_lines(floor_rows)
    values = [measured(r.peak_memory_bytes) for r in ok]
    values += [y for points, _ in probed.values() for _, y in points]
    unit = byte_unit(values + [y for line in floors.values() for _, y in line])
    lengths = [n for _, n in floor_rows]
    fig = go.Figure(
        layout=chart_layout(
            "Peak memory per rank",
            "sequence length (tokens)",
            f"peak memory per rank ({unit.name})",
            xaxis=length_axis(lengths),
            yaxis=log_axis(
                [unit.of(v) for v in values + [y for line in floors.values() for _, y in line]],
                f"peak memory per rank ({unit.name})",
                lambda v: f"{v:g}",
            ),
        )
    )
    if not ok and not probed:
        return empty_chart(fig, "No succeeded runs or probes with a measured peak memory yet")
    hover = "seq %{x}<br>%{y:.1f} " + unit.name
    for name, group in grouped(ok).items():
        fig.add_trace(
            go.Scatter(
                x=[r.length for r in group],
                y=[unit.of(measured(r.peak_memory_bytes)) for r in group],
                mode="lines+markers",
                name=name,
                line=styles.line(group[0]),
                marker=styles.marker(group[0]),
                customdata=[r.run_id for r in group],
                hovertemplate=hover + "<br>run %{customdata}<extra></extra>",
            )
        )
    for name, (points, run_id) in probed.items():
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in points],
                y=[unit.of(y) for _, y in points],
                mode="lines+markers",
                name=f"{name} (probes that fit)",
                hovertemplate=hover + f"<br>run {run_id}<extra></extra>",
            )
        )
    _add_floors(fig, floors, unit)
    return to_json(fig)


def _add_floors(fig: go.Figure, floors: dict[str, list[tuple[int, int]]], unit: ByteUnit) -> None:
    """Each distinct floor as a thin grey line, told apart by its dash."""
    for i, (name, line) in enumerate(floors.items()):
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in line],
                y=[unit.of(y) for _, y in line],
                mode="lines",
                name=name,
                line={"dash": DASHES[1 + i % (len(DASHES) - 1)], "color": "#777", "width": 1.5},
                hovertemplate="seq %{x}<br>floor %{y:.1f} " + unit.name + "<extra></extra>",
            )
        )


def probe_memory_points(rows: Sequence[Row]) -> dict[str, tuple[list[tuple[int, int]], int]]:
    """Peak memory of every probe that fit, (seq_len, bytes) per searched run, by legend label."""
    out: dict[str, tuple[list[tuple[int, int]], int]] = {}
    for r in sorted((r for r in rows if r.probes), key=lambda r: r.run_id):
        points = sorted(
            (p.seq_len, p.peak_memory_bytes)
            for p in r.probes
            if p.outcome == "fit" and p.peak_memory_bytes is not None
        )
        if points:
            out[r.label] = (points, r.run_id)
    return out


FLOOR_PARTS = ("h", "kv", "d", "dtype", "W", "parallel", "b")


def floor_lines(rows: Iterable[tuple[Row, int]]) -> dict[str, list[tuple[int, int]]]:
    """The forward floor per rank at each (row, length) (a run at its length, or a probe of its
    search at the probe's), (length, bytes) points, once per distinct floor (shapes
    whose floors coincide share one line), named by only what differs between the floors:
    "memory floor" alone, else "floor W=2", "floor d=64 W=1"."""
    keyed: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for r, length in rows:
        if r.workload == "model":
            continue  # q, k, v, out and lse are no floor of a whole model's training step
        key = (r.num_heads, r.num_kv_heads, r.head_dim, r.dtype, r.world_size)
        keyed[(*key, r.parallel, r.batch_size)].add(length)
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
    searched = sorted((r for r in rows if r.probes), key=lambda r: (r.label, r.run_id))
    fig = go.Figure(
        layout=chart_layout(
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
        return empty_chart(fig, "No maximum-length searches in this sweep")
    fig.update_xaxes(**_probed_axis(searched))
    cats = [wrapped(r.label) for r in searched]
    best = [r.max_seq_len for r in searched]
    probe_pts: dict[str, tuple[list[str], list[int], list[str]]] = {
        k: ([], [], []) for k in PROBE_STYLE
    }
    for cat, r in zip(cats, searched, strict=True):
        for p in r.probes:
            xs, ys, texts = probe_pts.setdefault(p.outcome, ([], [], []))
            xs.append(cat)
            ys.append(p.seq_len)
            texts.append(p.outcome + (" (emulated budget)" if p.emulated else ""))
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
    return to_json(fig)


def _probed_axis(searched: Sequence[Row]) -> Axis:
    """A length axis from just below the shortest probe to just above the longest."""
    lengths = [p.seq_len for r in searched for p in r.probes]
    lengths += [r.max_seq_len for r in searched if r.max_seq_len]
    axis = length_axis(lengths, "sequence length (tokens)")
    axis["range"] = [math.log10(min(lengths) / 1.5), math.log10(max(lengths) * 1.5)]
    return axis


def _scaling_name(r: Row, base: Row) -> str:
    name = f"{r.series} · seq {r.length:,}"
    if base.kernel != r.kernel:
        name += f" (vs {base.kernel} W={base.world_size})"
    return name


def scaling_points(rows: Sequence[Row]) -> dict[str, list[tuple[int, float]]]:
    """Scaling efficiency (service.results.baselines) per series and length: (world size,
    efficiency), starting at the baseline's world size with 1.0."""
    by_id = {r.run_id: r for r in rows}
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in succeeded(rows, "efficiency"):
        base = by_id[measured(r.baseline_run_id)]
        name = _scaling_name(r, base)
        if not series[name]:
            series[name].append((base.world_size, 1.0))
        series[name].append((r.world_size, measured(r.efficiency)))
    ordered = sorted(series.items(), key=lambda kv: natural_key(kv[0]))
    return {name: sorted(set(line)) for name, line in ordered}


def scaling_noise(rows: Sequence[Row]) -> dict[tuple[str, int], tuple[float, float, str]]:
    """(series, world size) -> (efficiency_lo, efficiency_hi, the flags' sentences) of each
    point of scaling_points that has an interval or a flag (the baseline's 1.0 has neither)."""
    by_id = {r.run_id: r for r in rows}
    out = {}
    for r in succeeded(rows, "efficiency"):
        name = _scaling_name(r, by_id[measured(r.baseline_run_id)])
        lo, hi = r.efficiency_lo, r.efficiency_hi
        flags = " ".join(f.text for f in r.flags or [] if f.field == "efficiency")
        if (lo is not None and hi is not None) or flags:
            eff = measured(r.efficiency)
            out[(name, r.world_size)] = (eff if lo is None else lo, eff if hi is None else hi,
                                            flags)  # fmt: skip
    return out


def scaling_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Scaling efficiency vs world size (1.0 = linear), for configs measured at W=1 and beyond,
    each point with its interval (both runs' noise) as an error bar; a point above 100% beyond
    the noise (flagged) is drawn as a red cross, its reason in the hover."""
    fig = go.Figure(
        layout=log_x_layout(
            "Scaling efficiency (bars: interval from both runs' noise; ✕: above 100%, flagged)",
            "world size (ranks)",
            "scaling efficiency (fraction of linear)",
        )
    )
    points = scaling_points(rows)
    if not points:
        return empty_chart(fig, "Scaling needs the same config measured at world size 1 and above")
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
    return to_json(fig)


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
    ok = succeeded(rows, "flops_per_s_per_rank")
    styles = styles or Styles(rows)
    y_title = "achieved / dense peak FLOP/s (fraction)"
    layout = chart_layout(
        "Fraction of dense peak",
        "sequence length (tokens)",
        y_title,
        xaxis=length_axis(r.length for r in ok),
        yaxis=zero_y_axis(y_title),
    )
    fig = go.Figure(layout=layout)
    if not ok:
        return empty_chart(fig, "No succeeded runs with measured FLOP/s yet")
    known = [r for r in ok if r.peak_fraction is not None]
    unknown = {
        f"{r.device or 'unrecorded device'} ({r.dtype})" for r in ok if r.peak_fraction is None
    }
    for name, group in grouped(known).items():
        fig.add_trace(
            go.Scatter(
                x=[r.length for r in group],
                y=[r.peak_fraction for r in group],
                mode="lines+markers",
                name=f"{name} · {group[0].device}",
                line=styles.line(group[0]),
                marker=styles.marker(group[0]),
                customdata=[measured(r.flops_per_s_per_rank) / 1e12 for r in group],
                hovertemplate="seq %{x}<br>%{y:.1%} of peak (%{customdata:.2f} TFLOP/s)"
                "<extra></extra>",
            )
        )
    if unknown:
        note = "no reference peak for " + ", ".join(sorted(unknown))
        note += " (achieved TFLOP/s is in the table)"
        if not known:
            return empty_chart(fig, note)
        fig.add_annotation(
            text=note, showarrow=False, xref="paper", yref="paper", x=0, y=1.08, xanchor="left"
        )
    return to_json(fig)


SCALING_MIN_WORLD_SIZES = 3
"""Fewer distinct world sizes than this: the scaling efficiency is a table, not a chart."""


def world_sizes(rows: Sequence[Row]) -> list[int]:
    return sorted({r.world_size for r in rows})


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
