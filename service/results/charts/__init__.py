"""Chart builders: the read model's rows (service.results.rows.RunRow) in, Plotly figure JSON out,
by audience: the sweep page's performance charts (performance), where a ring's time goes (ring),
training memory (training), packed documents' schemes and balances (documents),
one run (run), two sweeps compared (comparison); what they share
(common) and the sweep page's set (sweep).

Pure functions, so they are unit-tested on rows without a server. An empty chart says why it is
empty; no number is drawn that was not measured (the memory floor is computed from the shape).
"""

from __future__ import annotations

from service.results.charts.common import (
    DASHES,
    PALETTE,
    SYMBOLS,
    Styles,
    length_axis,
    log_axis,
    si_text,
    tokens_text,
    wrapped,
)
from service.results.charts.comparison import CHANGE_COLOURS, compare_figure
from service.results.charts.documents import documents_figure
from service.results.charts.performance import (
    PROBE_STYLE,
    SCALING_MIN_WORLD_SIZES,
    floor_lines,
    max_len_figure,
    memory_figure,
    peak_fraction_figure,
    probe_memory_points,
    scaling_figure,
    scaling_noise,
    scaling_points,
    scaling_table,
    throughput_figure,
    world_sizes,
)
from service.results.charts.ring import crossover_range, exposed_comm_figure, sp_schemes_figure
from service.results.charts.run import rank_times_figure, step_timeline_figure
from service.results.charts.sweep import sweep_figures
from service.results.charts.training import (
    components_figure,
    model_peak_figure,
    step_time_figure,
)
from service.units import natural_key

__all__ = [
    "CHANGE_COLOURS",
    "DASHES",
    "PALETTE",
    "PROBE_STYLE",
    "SCALING_MIN_WORLD_SIZES",
    "SYMBOLS",
    "Styles",
    "compare_figure",
    "components_figure",
    "crossover_range",
    "documents_figure",
    "exposed_comm_figure",
    "floor_lines",
    "length_axis",
    "log_axis",
    "max_len_figure",
    "memory_figure",
    "model_peak_figure",
    "natural_key",
    "peak_fraction_figure",
    "probe_memory_points",
    "rank_times_figure",
    "scaling_figure",
    "scaling_noise",
    "scaling_points",
    "scaling_table",
    "si_text",
    "sp_schemes_figure",
    "step_time_figure",
    "step_timeline_figure",
    "sweep_figures",
    "throughput_figure",
    "tokens_text",
    "world_sizes",
    "wrapped",
]
