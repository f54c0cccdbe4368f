"""Chart builders: result rows (service.views.RunRow.as_dict) in, Plotly figure JSON out.

Pure functions, so they are unit-tested on rows without a server. An empty chart says why it is
empty; no number is drawn that was not measured (the memory floor is computed from the shape).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from service.views import local_tokens, memory_floor

Row = dict[str, Any]

PROBE_STYLE = {
    "fit": {"color": "#2ca02c", "symbol": "circle"},
    "oom": {"color": "#d62728", "symbol": "x"},
    "error": {"color": "#ff7f0e", "symbol": "diamond"},
}


def _to_json(fig: go.Figure) -> dict[str, Any]:
    return json.loads(fig.to_json())


def _layout(title: str, x: str, y: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": x}},
        "yaxis": {"title": {"text": y}},
        "margin": {"l": 70, "r": 20, "t": 50, "b": 60},
        "legend": {"orientation": "h", "y": -0.25, "yanchor": "top"},
        "template": "plotly_white",
        **extra,
    }


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
    """Rows by legend label (the row's label, or its series label without the world size)."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r["label"] if with_world else r["series"]].append(r)
    return {k: sorted(v, key=lambda r: r["length"]) for k, v in sorted(groups.items())}


def throughput_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Tokens/s vs sequence length, one line per kernel variant and world size, log-log."""
    fig = go.Figure(
        layout=_layout(
            "Throughput",
            "sequence length (tokens)",
            "tokens/s",
            xaxis={"type": "log", "title": {"text": "sequence length (tokens)"}},
            yaxis={"type": "log", "title": {"text": "tokens/s"}},
        )
    )
    ok = _succeeded(rows, "tokens_per_s")
    if not ok:
        return _empty(fig, "No succeeded runs with a measured time yet")
    for name, group in _grouped(ok).items():
        fig.add_trace(
            go.Scatter(
                x=[r["length"] for r in group],
                y=[r["tokens_per_s"] for r in group],
                mode="lines+markers",
                name=name,
                customdata=[r["run_id"] for r in group],
                hovertemplate="seq %{x}<br>%{y:.4s} tokens/s<br>run %{customdata}<extra></extra>",
            )
        )
    return _to_json(fig)


def memory_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Peak memory per rank vs sequence length, with the forward memory floor as dashed lines."""
    fig = go.Figure(
        layout=_layout(
            "Peak memory per rank",
            "sequence length (tokens)",
            "bytes",
            xaxis={"type": "log", "title": {"text": "sequence length (tokens)"}},
            yaxis={"type": "log", "title": {"text": "peak memory per rank"}, "ticksuffix": "B"},
        )
    )
    ok = _succeeded(rows, "peak_memory_bytes")
    probed = probe_memory_points(rows)
    if not ok and not probed:
        return _empty(fig, "No succeeded runs or probes with a measured peak memory yet")
    for name, group in _grouped(ok).items():
        fig.add_trace(
            go.Scatter(
                x=[r["length"] for r in group],
                y=[r["peak_memory_bytes"] for r in group],
                mode="lines+markers",
                name=name,
                customdata=[r["run_id"] for r in group],
                hovertemplate="seq %{x}<br>%{y:.4s}B<br>run %{customdata}<extra></extra>",
            )
        )
    for name, (points, run_id) in probed.items():
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in points],
                y=[y for _, y in points],
                mode="lines+markers",
                name=f"{name} (probes that fit)",
                hovertemplate=f"seq %{{x}}<br>%{{y:.4s}}B<br>run {run_id}<extra></extra>",
            )
        )
    floor_rows = list(ok) + [
        {**r, "length": p["seq_len"]}
        for r in rows
        for p in r["probes"]
        if p["outcome"] == "fit" and p["peak_memory_bytes"] is not None
    ]
    for name, line in floor_lines(floor_rows).items():
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in line],
                y=[y for _, y in line],
                mode="lines",
                name=name,
                line={"dash": "dash", "color": "#555"},
                hovertemplate="seq %{x}<br>floor %{y:.4s}B<extra></extra>",
            )
        )
    return _to_json(fig)


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


def floor_lines(rows: Sequence[Row]) -> dict[str, list[tuple[int, int]]]:
    """The forward floor per rank, (length, bytes) points, per distinct shape in rows."""
    keyed: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for r in rows:
        if r.get("workload") == "model":
            continue  # q, k, v, out and lse are no floor of a whole model's training step
        key = (r["num_heads"], r["num_kv_heads"], r["head_dim"], r["dtype"], r["world_size"])
        keyed[(*key, r["parallel"], r["batch_size"])].add(r["length"])
    lines: dict[str, list[tuple[int, int]]] = {}
    for (h, kv, d, dtype, w, parallel, batch), lengths in sorted(keyed.items()):
        name = f"floor h={h}{f' kv={kv}' if kv != h else ''} d={d} {dtype} W={w}"
        if parallel == "data":
            name += " data"
        if batch != 1:
            name += f" b={batch}"
        points = []
        for s in sorted(lengths):
            floor = memory_floor(dtype, h, d, local_tokens(parallel, w, batch, s), kv)
            if floor is not None:
                points.append((s, floor))
        if points:
            lines[name] = points
    return lines


def max_len_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Largest length that fit per run (horizontal bars: long labels stay readable), every probe
    as a marker on the same row."""
    searched = sorted((r for r in rows if r["probes"]), key=lambda r: (r["label"], r["run_id"]))
    fig = go.Figure(
        layout=_layout(
            "Maximum sequence length",
            "tokens",
            "",
            xaxis={"type": "log", "title": {"text": "sequence length (tokens)"}},
            yaxis={"automargin": True, "autorange": "reversed"},
            barmode="overlay",
            height=max(320, 140 + 40 * len(searched)),
        )
    )
    if not searched:
        return _empty(fig, "No maximum-length searches in this sweep")
    cats = [r["label"] for r in searched]
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


def _scaling_name(r: Row, base: Row) -> str:
    name = f"{r['series']} · seq {r['length']:,}"
    if base["kernel"] != r["kernel"]:
        name += f" (vs {base['kernel']} W={base['world_size']})"
    return name


def scaling_points(rows: Sequence[Row]) -> dict[str, list[tuple[int, float]]]:
    """Scaling efficiency (service.analysis) per series and length: (world size, efficiency),
    starting at the baseline's world size with 1.0."""
    by_id = {r["run_id"]: r for r in rows}
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in _succeeded(rows, "efficiency"):
        base = by_id[r["baseline_run_id"]]
        name = _scaling_name(r, base)
        if not series[name]:
            series[name].append((base["world_size"], 1.0))
        series[name].append((r["world_size"], r["efficiency"]))
    return {name: sorted(set(line)) for name, line in sorted(series.items())}


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
        layout=_layout(
            "Scaling efficiency (bars: interval from both runs' noise; ✕: above 100%, flagged)",
            "world size",
            "efficiency",
            xaxis={"type": "log", "title": {"text": "world size (ranks)"}},
            yaxis={"title": {"text": "tokens/s(W) / (W · tokens/s(1))"}, "rangemode": "tozero"},
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
        spans = [noise.get((name, w), (e, e, "")) for w, e in line]
        fig.add_trace(
            go.Scatter(
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
        )
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


def peak_fraction_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Achieved FLOP/s per rank as a fraction of the device's dense peak, when it is known."""
    fig = go.Figure(
        layout=_layout(
            "Fraction of dense peak",
            "sequence length (tokens)",
            "fraction",
            xaxis={"type": "log", "title": {"text": "sequence length (tokens)"}},
            yaxis={"title": {"text": "achieved / dense peak FLOP/s"}, "rangemode": "tozero"},
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
            "Throughput ratio B / A per matching cell, with its interval (red: slower, green: "
            "faster, beyond both medians' 95% intervals)",
            "tokens/s B / A",
            "",
            xaxis={"type": "log", "title": {"text": "tokens/s B / A"}},
            yaxis={"automargin": True, "autorange": "reversed"},
            height=max(320, 140 + 32 * len(with_ratio)),
        )
    )
    if not with_ratio:
        return _empty(fig, "No matching cells with a throughput in both sweeps")
    ratios = [p["tps_ratio"] for p in with_ratio]
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


def sweep_figures(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Every chart of the sweep page, keyed by the element id that draws it; a sweep with
    model cells adds seed 004's three."""
    figures = {
        "chart-throughput": throughput_figure(rows),
        "chart-memory": memory_figure(rows),
        "chart-maxlen": max_len_figure(rows),
        "chart-scaling": scaling_figure(rows),
        "chart-peak": peak_fraction_figure(rows),
    }
    if any(r.get("exposed_comm_share") is not None for r in rows):
        figures["chart-comm"] = exposed_comm_figure(rows)
    models = [r for r in rows if r.get("workload") == "model"]
    if models:
        figures["chart-components"] = components_figure(models)
        figures["chart-model-peak"] = model_peak_figure(models)
        figures["chart-step-time"] = step_time_figure(models)
    return figures


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
            "GiB per rank",
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
            "GiB per rank",
        )
    )
    drawn = False
    for name, group in _grouped([r for r in rows if r["status"] != "queued"], False).items():
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
        if measured:
            measured.sort()
            fig.add_trace(
                go.Scatter(
                    x=[m[0] for m in measured],
                    y=[m[1] for m in measured],
                    mode="markers",
                    name=f"{name} measured",
                    legendgroup=name,
                )
            )
            drawn = True
        if predicted:
            predicted = sorted(set(predicted))
            fig.add_trace(
                go.Scatter(
                    x=[q[0] for q in predicted],
                    y=[q[1] for q in predicted],
                    mode="lines",
                    line={"dash": "dash"},
                    name=f"{name} predicted",
                    legendgroup=name,
                )
            )
            drawn = True
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


def step_time_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Each model run's step split into forward, backward and optimizer (slowest rank's
    medians): the step-time cost of checkpointing shows as the longer backward."""
    timed = [r for r in rows if r.get("forward_s") is not None]
    fig = go.Figure(
        layout=_bar_layout("Step time by phase", "seconds per step", len(timed), barmode="stack")
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
    fig = go.Figure(layout=_layout("Timed repeats per rank", "rank", "seconds"))
    with_times = [r for r in ranks if r.get("times_s")]
    if not with_times:
        return _empty(fig, "No timed repeats recorded for this run")
    for r in with_times:
        fig.add_trace(go.Box(y=r["times_s"], name=f"rank {r['rank']}", boxpoints="all", jitter=0.3))
    fig.update_layout(showlegend=False)
    return _to_json(fig)


# ---------------------------------------------------------------- where the time goes (ring)

STEP_COLOURS = {"compute": "#1f77b4", "wait": "#d62728"}


def exposed_comm_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Exposed-communication share against tokens per rank, one line per ring variant and
    world size; each series' F/B crossover (tokens per rank) marked by a dashed line."""
    fig = go.Figure(
        layout=_layout(
            "Exposed communication",
            "tokens per rank",
            "share of step time blocked on transfers",
            xaxis={"type": "log", "title": {"text": "tokens per rank"}},
            yaxis={
                "title": {"text": "share of step time blocked on transfers"},
                "tickformat": ".0%",
                "rangemode": "tozero",
            },
        )
    )
    ok = _succeeded(rows, "exposed_comm_share")
    if not ok:
        return _empty(fig, "No ring run has stored its steps yet")
    for name, group in _grouped(ok).items():
        tokens = [
            local_tokens(r["parallel"], r["world_size"], r["batch_size"], r["length"])
            for r in group
        ]
        fig.add_trace(
            go.Scatter(
                x=tokens,
                y=[r["exposed_comm_share"] for r in group],
                mode="lines+markers",
                name=name,
                hovertemplate="%{x:,} tokens per rank: %{y:.1%} blocked<extra>" + name + "</extra>",
            )
        )
        crossings = sorted(r["crossover_tokens"] for r in group if r.get("crossover_tokens"))
        if crossings:  # a vertical line as a trace: named in the legend, on the log axis
            at = crossings[len(crossings) // 2]
            basis = next(r["crossover_basis"] for r in group if r.get("crossover_tokens"))
            top = max(r["exposed_comm_share"] for r in ok) or 1.0
            fig.add_trace(
                go.Scatter(
                    x=[at, at],
                    y=[0, top],
                    mode="lines",
                    line={"dash": "dash", "color": "#7f7f7f"},
                    name=f"F/B crossover {at:,.0f} tokens ({basis}): {name}",
                    hoverinfo="name",
                )
            )
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
    fig = go.Figure(layout=_layout("Ring steps per rank (median iteration)", "seconds", "rank"))
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
