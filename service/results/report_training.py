"""report.md's training memory sections (model cells, seed 004): memory per model cell found
and predicted, memory per component predicted and measured, and the step time by phase.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.results.report_format import (
    fmt_bytes,
    fmt_num,
    fmt_pct,
    fmt_x,
    ratio_cell,
    table,
)
from service.results.rows import RunRow
from service.units import MS, TimeUnit

COMPONENT_TITLES = {
    "parameters": "Parameters",
    "gradients": "Gradients",
    "optimizer_states": "Optimizer states",
    "optimizer_state_tensors": "Optimizer states (bytes in optimizer.state)",
    "activations": "Activations saved for backward",
    "forward_transient": "Forward transient peak",
    "backward_peak": "Backward peak",
    "step_peak": "Step peak",
    "allocator_overhead": "Allocator overhead (reserved - allocated)",
}
"""How the report and the dashboard name each memory component."""


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def model_sections(rows: Sequence[RunRow], unit: TimeUnit = MS) -> list[str]:
    """Seed 004's tables: training memory per model cell (max tokens found and predicted,
    fixed memory, memory per token, against the baseline), memory per component predicted
    and measured, and the step time by phase with the cost of checkpointing."""
    return [*_training_memory(rows), *_component_table(rows), *_step_time_table(rows, unit)]


TRAINING_MEMORY_HEADER = [
    "Model", "d × heads × layers", "Optimizer", "Precision", "Checkpointing", "Tokens measured",
    "Max tokens found", "Max tokens predicted", "Fixed", "KB per token", "Step peak",
    "Step peak predicted",
]  # fmt: skip
"""The training memory table's columns but its last (the gain against the baseline)."""


def _training_memory(rows: Sequence[RunRow]) -> list[str]:
    """One line per model cell: its setup, the tokens found and predicted, fixed memory,
    memory per token and the step peak, and its gain against the baseline run named."""
    searched = any(r.searched for r in rows)
    gain_title = "Max-length gain" if searched else "Memory ratio"
    body = [_training_memory_cells(r) for r in rows]
    return [
        "## Training memory",
        "",
        "Per model cell, on its limiting rank: fixed = parameters + gradients + optimizer "
        "states (measured); KB per token = (step peak - fixed) / tokens the rank holds; "
        "predicted values come from the cell alone (workers/model_memory.py) before it ran; "
        "the last column compares with the baseline run named (see Against the baseline).",
        "",
        *table([*TRAINING_MEMORY_HEADER, gain_title], body),
        "",
    ]


def _training_memory_cells(r: RunRow) -> list[str]:
    """One model cell's line of the training memory table."""
    found = r.max_seq_len if r.searched else None
    gain = r.max_len_gain if r.searched else r.memory_ratio
    chunk = (r.config.get("training") or {}).get("loss_chunk_tokens")
    checkpointing = r.checkpointing or "-"
    if chunk is not None:
        checkpointing += f" · loss in chunks of {chunk:,}"
    return [
        r.model or "-", r.model_shape or "-", r.optimizer or "-", r.precision or "-",
        checkpointing, fmt_num(r.measured_seq_len), fmt_num(found),
        fmt_num(r.predicted_max_seq_len), fmt_bytes(r.fixed_bytes),
        "-" if r.bytes_per_token is None else f"{r.bytes_per_token / 1e3:,.1f}",
        fmt_bytes(r.peak_memory_bytes), fmt_bytes(r.predicted_peak_bytes),
        f"{fmt_x(gain)} vs run {r.baseline_run_id}" if gain is not None else "-",
    ]  # fmt: skip


def _component_table(rows: Sequence[RunRow]) -> list[str]:
    """Every model cell's memory components (its limiting rank), predicted and measured."""
    lines = ["### Memory per component, predicted and measured", ""]
    body = [
        [r.label, f"{r.length:,}", str(c.rank), COMPONENT_TITLES.get(c.component, c.component),
         fmt_bytes(c.predicted_bytes), fmt_bytes(c.measured_bytes), fmt_ratio(c.ratio)]
        for r in rows
        for c in r.components
    ]  # fmt: skip
    if not body:
        return [*lines, "No model run has stored its components yet.", ""]
    header = ["Run", "Tokens", "Rank", "Component", "Predicted", "Measured",
              "Measured / predicted"]  # fmt: skip
    return [*lines, *table(header, body), ""]


def _step_time_table(rows: Sequence[RunRow], unit: TimeUnit = MS) -> list[str]:
    """Each timed model cell's step by phase, its MFU and the cost of checkpointing."""
    timed = [r for r in rows if r.median_s is not None]
    if not timed:
        return []
    body = [
        [r.label, f"{r.length:,}", unit(r.forward_s), unit(r.backward_s),
         unit(r.optimizer_s), unit(r.median_s), fmt_num(r.tokens_per_s),
         fmt_pct(r.peak_fraction), ratio_cell(r, "checkpoint_time_ratio", fmt_x)]
        for r in timed
    ]  # fmt: skip
    header = ["Run", "Tokens", "Forward", "Backward", "Optimizer", "Step", "Tokens/s", "MFU",
              "Checkpointing cost"]  # fmt: skip
    return [
        "### Step time by phase",
        "",
        "The slowest rank's medians; MFU = model FLOP/s per rank (6 x parameters per token "
        "plus the kernel's attention FLOPs) / the device's dense peak; checkpointing cost "
        "= step time / the same cell's without checkpointing.",
        "",
        *table(header, body),
        "",
    ]
