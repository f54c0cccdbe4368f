"""report.md's "Packed documents: balance and schemes" as a chart of the sweep page: each scheme
and balance's time per length under a documents mask, with each bar's kept-pairs imbalance,
measured imbalance and % of ideal (service.results.work_share) in its hover.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from service.results.charts.common import PALETTE, Row, chart_layout, to_json
from service.results.report_documents import fmt_ideal, fmt_imbalance, scheme
from service.results.work_share import documents_mask, timed
from service.units import natural_key

TITLE = "Packed documents: balance and schemes"
FASTEST_OUTLINE = 2.5
"""The outline's width (px) of the fastest bar of each length and world size."""


def scheme_text(row: Row) -> str:
    """A bar's category: the scheme as the section names it and its balance ("ring · ptrr",
    "allgather_kv · gather=needed · ptrr"; the scheme alone when it takes none)."""
    balance = row.params.get("balance")
    return scheme(row) if balance is None else f"{scheme(row)} · {balance}"


def bar_text(row: Row) -> str:
    """What a bar says of its run: its imbalances (kept pairs, measured) and % of ideal."""
    return (
        f"kept {fmt_imbalance(row.kept_pairs_imbalance)} · measured "
        f"{fmt_imbalance(row.compute_imbalance)} · wasted comm "
        f"{fmt_ideal(row.wasted_comm_share)} · {fmt_ideal(row.ideal_fraction)} of ideal"
    )


def documents_figure(rows: Sequence[Row]) -> dict[str, Any]:
    """Time per iteration (ms, the slowest rank's median) of every scheme and balance, one bar
    group per scheme, one bar per length and world size (the fastest of each outlined); {}
    when no run over several ranks ran under a documents mask (the page draws no panel)."""
    shown = [r for r in rows if documents_mask(r) and r.world_size > 1 and timed(r)]
    if not shown:
        return {}
    fig = go.Figure(
        layout=chart_layout(
            TITLE,
            "scheme (· its balance)",
            "time per iteration (ms)",
            barmode="group",
            yaxis={"title": {"text": "time per iteration (ms)"}, "rangemode": "tozero"},
        )
    )
    order = sorted({scheme_text(r) for r in shown}, key=natural_key)
    bars: dict[tuple[int, int, str], list[Row]] = defaultdict(list)
    for r in shown:
        bars[(r.length, r.world_size, r.mode)].append(r)
    modes = {mode for _, _, mode in bars}
    for i, ((length, world, mode), group) in enumerate(sorted(bars.items())):
        group = sorted(group, key=lambda r: order.index(scheme_text(r)))
        fastest = min(group, key=lambda r: (r.median_s or 0.0, r.run_id)).run_id
        name = f"{length:,} tokens · W={world}" + (f" · {mode}" if len(modes) > 1 else "")
        fig.add_trace(
            go.Bar(
                x=[scheme_text(r) for r in group],
                y=[(r.median_s or 0.0) * 1e3 for r in group],
                name=name,
                marker={
                    "color": PALETTE[i % len(PALETTE)],
                    "line": {  # the fastest of its length outlined, as the report marks it
                        "color": "#000000",
                        "width": [FASTEST_OUTLINE if r.run_id == fastest else 0 for r in group],
                    },
                },
                text=[bar_text(r) + (" · fastest" if r.run_id == fastest else "") for r in group],
                textposition="none",
                customdata=[r.run_id for r in group],
                hovertemplate="%{x}: %{y:.3f} ms<br>%{text}<br>run %{customdata}<extra>"
                + name
                + "</extra>",
            )
        )
    fig.update_xaxes(categoryorder="array", categoryarray=order)
    return to_json(fig)
