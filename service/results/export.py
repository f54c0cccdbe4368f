"""The flat exports of a sweep's rows (service.results.rows): results.json rows, results.csv,
components.csv and pivot.csv.

No number is computed here: every value is a field of the row; this module only picks and
lays them out, so the report, the CSV and the dashboard cannot disagree.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from service.results import baselines
from service.results.rows import RunRow
from service.spec import PivotSpec, canonical_json

CSV_COLUMNS = (
    "run_id",
    "sweep_id",
    "label",
    "kernel",
    "params",
    "seq_len",
    "measured_seq_len",
    "world_size",
    "batch_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "causal",
    "mode",
    "parallel",
    "status",
    "outcome",
    "attempts",
    "median_s",
    "p10_s",
    "p90_s",
    "median_lo_s",
    "median_hi_s",
    "median_ci_level",
    "iterations",
    "tokens_per_s",
    "tflops_per_s",
    "flops_per_s_per_rank",
    "peak_fraction",
    "peak_memory_bytes",
    "rank_peak_bytes",
    "input_memory_bytes",
    "resident_peak_bytes",
    "floor_bytes",
    "memory_per_token_bytes",
    "max_seq_len",
    "exposed_comm_share",
    "step_coverage",
    "comm_bytes_per_rank",
    "step_flops_per_s_per_rank",
    "ulysses_groups",
    "link_probe_bytes_per_s",
    "link_latency_s",
    "link_kind",
    "crossover_tokens",
    "crossover_basis",
    "backend",
    "max_abs_error",
    "check_seq_len",
    "sampled_check_error",
    "sampled_check_seq_len",
    "sampled_check_rows",
    "baseline_run_id",
    "baseline",
    "speedup",
    "memory_ratio",
    "max_len_gain",
    "efficiency",
    "speedup_lo",
    "speedup_hi",
    "efficiency_lo",
    "efficiency_hi",
    "within_noise",
    "flags",
    "workload",
    "model",
    "model_shape",
    "optimizer",
    "precision",
    "checkpointing",
    "fixed_bytes",
    "predicted_fixed_bytes",
    "bytes_per_token",
    "predicted_peak_bytes",
    "predicted_max_seq_len",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "checkpoint_time_ratio",
    "checkpoint_time_ratio_lo",
    "checkpoint_time_ratio_hi",
    "device",
    "environment_id",
    "error",
)
COMPONENT_CSV_COLUMNS = (
    "run_id",
    "label",
    "measured_seq_len",
    "rank",
    "component",
    "predicted_bytes",
    "measured_bytes",
    "ratio",
)


def result_row(row: RunRow) -> dict[str, Any]:
    """One flat row of results.json / results.csv."""
    out = {k: getattr(row, k) for k in CSV_COLUMNS if k not in ("params", "flags")}
    out["params"] = canonical_json(row.params)
    out["flags"] = [{"code": f.code, "field": f.field, "text": f.text} for f in row.flags]
    out["components"] = [
        {
            "rank": c.rank,
            "component": c.component,
            "predicted_bytes": c.predicted_bytes,
            "measured_bytes": c.measured_bytes,
            "ratio": c.ratio,
        }
        for c in row.components
    ]
    return out


def components_csv(rows: Sequence[RunRow]) -> str:
    """Every model run's memory components (its limiting rank), one line each: the seed's
    per-component table with raw bytes."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COMPONENT_CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        for c in r.components:
            writer.writerow(
                {
                    "run_id": r.run_id,
                    "label": r.label,
                    "measured_seq_len": _csv_cell(r.measured_seq_len),
                    "rank": c.rank,
                    "component": c.component,
                    "predicted_bytes": _csv_cell(c.predicted_bytes),
                    "measured_bytes": _csv_cell(c.measured_bytes),
                    "ratio": _csv_cell(c.ratio),
                }
            )
    return buf.getvalue()


def to_csv(rows: Sequence[dict[str, Any]], *, header: bool = True) -> str:
    """CSV with a header row (unless it continues a stream); empty cells for missing values;
    per-rank lists joined by ';'."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        cells = {k: _csv_cell(row[k]) for k in CSV_COLUMNS if k != "flags"}
        cells["flags"] = ";".join(f"{f['field']}:{f['code']}" for f in row["flags"])
        writer.writerow(cells)
    return buf.getvalue()


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, list):
        return ";".join("" if v is None else str(v) for v in value)
    return value


def pivot_csv(rows: Sequence[RunRow], spec: PivotSpec) -> str:
    """The pivot as CSV: a column per section field (what else varies), the row value, then one
    column per column value (raw numbers)."""
    table = baselines.pivot(rows, spec)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    fields = table.section_fields
    writer.writerow([*fields, table.row_header, *table.columns])
    for section in table.sections:
        for name, values in section.rows:
            writer.writerow([*section.values, name, *("" if v is None else v for v in values)])
    return buf.getvalue()
