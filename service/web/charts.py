"""Chart builders: result rows (service.web.rows.run_row) in, Plotly figure JSON out.

Pure functions, so they are unit-tested on rows without a server. An empty chart says why it is
empty; no number is drawn that was not measured (the memory floor is computed from the shape).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from service.web.peaks import dense_peak_flops
from service.web.rows import SERIES_FIELDS, memory_floor_bytes

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
        "legend": {"orientation": "h", "y": -0.25},
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


def varying_fields(rows: Sequence[Row]) -> list[str]:
    """The series fields (dtype, mode, ...) that take more than one value among rows."""
    return [f for f in SERIES_FIELDS if len({r[f] for r in rows}) > 1]


def series_name(row: Row, varying: Iterable[str], with_world: bool = True) -> str:
    """A legend label: variant, world size, data parallelism, and the other fields that vary."""
    parts = [row["variant"]]
    if with_world:
        parts.append(f"W={row['world_size']}")
    if row["parallel"] == "data":
        parts.append(f"data-parallel b={row['batch_size']}")
    parts += [f"{f}={row[f]}" for f in varying if f not in ("parallel", "batch_size")]
    return " · ".join(parts)


def _succeeded(rows: Iterable[Row], metric: str) -> list[Row]:
    return [r for r in rows if r["status"] == "succeeded" and r.get(metric) is not None]


def _grouped(rows: Sequence[Row], with_world: bool = True) -> dict[str, list[Row]]:
    varying = varying_fields(rows)
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[series_name(r, varying, with_world)].append(r)
    return {k: sorted(v, key=lambda r: r["seq_len"]) for k, v in sorted(groups.items())}


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
                x=[r["seq_len"] for r in group],
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
                x=[r["seq_len"] for r in group],
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
        {**r, "seq_len": p["seq_len"]}
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
    searched = [r for r in rows if r["probes"]]
    varying = varying_fields(searched)
    out: dict[str, tuple[list[tuple[int, int]], int]] = {}
    for r in sorted(searched, key=lambda r: r["run_id"]):
        points = sorted(
            (p["seq_len"], p["peak_memory_bytes"])
            for p in r["probes"]
            if p["outcome"] == "fit" and p["peak_memory_bytes"] is not None
        )
        if points:
            out[series_name(r, varying)] = (points, r["run_id"])
    return out


def floor_lines(rows: Sequence[Row]) -> dict[str, list[tuple[int, int]]]:
    """The forward floor per rank, (seq_len, bytes) points, per distinct shape in rows."""
    keyed: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for r in rows:
        if memory_floor_bytes(r) is None:
            continue
        key = (r["num_heads"], r["head_dim"], r["dtype"], r["world_size"], r["parallel"])
        keyed[(*key, r["batch_size"])].add(r["seq_len"])
    lines: dict[str, list[tuple[int, int]]] = {}
    for (h, d, dtype, w, parallel, batch), seqs in sorted(keyed.items()):
        name = f"floor h={h} d={d} {dtype} W={w}"
        if parallel == "data":
            name += " data"
        if batch != 1:
            name += f" b={batch}"
        proto = {
            "num_heads": h,
            "head_dim": d,
            "dtype": dtype,
            "world_size": w,
            "parallel": parallel,
            "batch_size": batch,
        }
        lines[name] = [(s, memory_floor_bytes({**proto, "seq_len": s}) or 0) for s in sorted(seqs)]
    return lines


def max_len_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Largest length that fit per kernel variant x world size (bars), every probe as a marker."""
    fig = go.Figure(
        layout=_layout(
            "Maximum sequence length",
            "kernel · world size",
            "tokens",
            yaxis={"type": "log", "title": {"text": "sequence length (tokens)"}},
            barmode="overlay",
        )
    )
    searched = [r for r in rows if r["probes"]]
    if not searched:
        return _empty(fig, "No maximum-length searches in this sweep")
    varying = varying_fields(searched)
    cats, best = [], []
    probe_pts: dict[str, tuple[list[str], list[int], list[str]]] = {
        k: ([], [], []) for k in PROBE_STYLE
    }
    for r in sorted(searched, key=lambda r: (r["variant"], r["world_size"], r["run_id"])):
        cat = series_name(r, varying)
        cats.append(cat)
        best.append(r["max_seq_len"])
        for p in r["probes"]:
            xs, ys, texts = probe_pts.setdefault(p["outcome"], ([], [], []))
            xs.append(cat)
            ys.append(p["seq_len"])
            texts.append(p["outcome"] + (" (emulated budget)" if p.get("emulated") else ""))
    fig.add_trace(
        go.Bar(
            x=cats,
            y=best,
            name="max length that fit",
            marker={"color": "#9ecae1"},
            text=[f"{b:,}" if b else "none fit" for b in best],
            textposition="outside",
        )
    )
    for outcome, (xs, ys, texts) in probe_pts.items():
        if not xs:
            continue
        style = PROBE_STYLE.get(outcome, {"color": "#333", "symbol": "square"})
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                name=f"probe: {outcome}",
                marker={"color": style["color"], "symbol": style["symbol"], "size": 10},
                text=texts,
                hovertemplate="%{x}<br>probe %{y:,}: %{text}<extra></extra>",
            )
        )
    return _to_json(fig)


# A ring kernel's single-process twin: its W=1 baseline when the sweep has no ring run at W=1.
RING_TWINS = {"ring": "dense", "ring_dilated": "dilated", "ring_block_sparse": "block_sparse"}
RING_ONLY_PARAMS = ("layout", "group")


def _baseline_key(r: Row) -> tuple[Any, ...]:
    """What must match between a run and its W=1 baseline: the problem one rank's share of
    the work scales from (same kernel family and parameters, length, per-rank batch, shape)."""
    kernel = RING_TWINS.get(r["kernel"], r["kernel"])
    params = {k: v for k, v in r["params"].items() if k not in RING_ONLY_PARAMS}
    per_rank_batch = (
        r["batch_size"] // r["world_size"] if r["parallel"] == "data" else r["batch_size"]
    )
    return (
        kernel,
        json.dumps(params, sort_keys=True),
        r["seq_len"],
        per_rank_batch,
        r["dtype"],
        r["mode"],
        r["causal"],
        r["num_heads"],
        r["head_dim"],
    )


def scaling_points(rows: Sequence[Row]) -> dict[str, list[tuple[int, float]]]:
    """Scaling efficiency tokens/s(W) / (W * tokens/s(1)) per series with a W=1 baseline.

    Sequence parallel (ring) is strong scaling at a fixed length: its baseline is the same
    kernel at W=1, else its single-process twin (ring -> dense). Data parallel is weak scaling:
    the baseline runs one rank's share of the batch on one process.
    """
    ok = _succeeded(rows, "tokens_per_s")
    baselines: dict[tuple[Any, ...], Row] = {}
    for r in ok:
        if r["world_size"] == 1:
            key = _baseline_key(r)
            # The kernel itself at W=1 wins over its twin.
            if key not in baselines or r["kernel"] not in RING_TWINS.values():
                baselines[key] = r
    varying = varying_fields(ok)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in ok:
        base = baselines.get(_baseline_key(r))
        if base is None or r["world_size"] == 1:
            continue
        name = f"{series_name(r, varying, with_world=False)} · seq {r['seq_len']:,}"
        if base["kernel"] != r["kernel"]:
            name += f" (vs {base['kernel']} W=1)"
        w = r["world_size"]
        series[name].append((w, r["tokens_per_s"] / (w * base["tokens_per_s"])))
    return {name: [(1, 1.0), *sorted(line)] for name, line in sorted(series.items())}


def scaling_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Scaling efficiency vs world size (1.0 = linear), for configs measured at W=1 and beyond."""
    fig = go.Figure(
        layout=_layout(
            "Scaling efficiency",
            "world size",
            "efficiency",
            xaxis={"type": "log", "title": {"text": "world size (ranks)"}},
            yaxis={"title": {"text": "tokens/s(W) / (W · tokens/s(1))"}, "rangemode": "tozero"},
        )
    )
    points = scaling_points(rows)
    if not points:
        return _empty(fig, "Scaling needs the same config measured at world size 1 and above")
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
        fig.add_trace(
            go.Scatter(
                x=[w for w, _ in line],
                y=[e for _, e in line],
                mode="lines+markers",
                name=name,
                hovertemplate="W=%{x}<br>efficiency %{y:.2f}<extra></extra>",
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
    known, unknown = [], set()
    for r in ok:
        peak = dense_peak_flops(r["device"], r["dtype"])
        if peak is None:
            unknown.add(f"{r['device'] or 'unrecorded device'} ({r['dtype']})")
        else:
            known.append({**r, "_fraction": r["flops_per_s_per_rank"] / peak})
    for name, group in _grouped(known).items():
        fig.add_trace(
            go.Scatter(
                x=[r["seq_len"] for r in group],
                y=[r["_fraction"] for r in group],
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


def compare_figure(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s ratio B/A per matching cell; below 1 means B is slower."""
    fig = go.Figure(
        layout=_layout(
            "Throughput ratio B / A per matching cell",
            "cell",
            "ratio",
            yaxis={"type": "log", "title": {"text": "tokens/s B / A"}},
        )
    )
    with_ratio = [p for p in pairs if p.get("tps_ratio") is not None]
    if not with_ratio:
        return _empty(fig, "No matching cells with a throughput in both sweeps")
    fig.add_trace(
        go.Bar(
            x=[p["label"] for p in with_ratio],
            y=[p["tps_ratio"] for p in with_ratio],
            marker={"color": ["#d62728" if p["regression"] else "#1f77b4" for p in with_ratio]},
            name="tokens/s B / A",
            hovertemplate="%{x}<br>%{y:.3f}<extra></extra>",
        )
    )
    return _to_json(fig)


def sweep_figures(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Every chart of the sweep page, keyed by the element id that draws it."""
    return {
        "chart-throughput": throughput_figure(rows),
        "chart-memory": memory_figure(rows),
        "chart-maxlen": max_len_figure(rows),
        "chart-scaling": scaling_figure(rows),
        "chart-peak": peak_fraction_figure(rows),
    }


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
