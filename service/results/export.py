"""The flat exports of a sweep's rows (service.results.rows): results.json rows, results.csv,
components.csv and pivot.csv.

No number is computed here: every value is a field of the row; this module only picks and
lays them out, so the report, the CSV and the dashboard cannot disagree.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any, get_type_hints

from pydantic import BaseModel, Field, create_model

from service.results import baselines
from service.results.labels import axis_value
from service.results.pivot import pivot_layout, row_text, section_title
from service.results.rows import RunRow
from service.results.stored import StoredComponent
from service.spec import PivotSpec, canonical_json

EXPORTED = tuple(f.name for f in fields(RunRow) if f.metadata.get("export", True))
"""results.json's fields, in order: RunRow's fields marked for export (rows._doc)."""
JSON_ONLY = ("components",)
CSV_MOVED = {"ulysses_groups": "step_flops_per_s_per_rank"}
"""A column results.csv has always placed elsewhere than results.json: after the one named
(both came in one change; files already written keep their layout)."""


def _csv_columns() -> tuple[str, ...]:
    """results.csv's columns: results.json's but the nested components (components.csv),
    with CSV_MOVED applied."""
    columns = [name for name in EXPORTED if name not in JSON_ONLY and name not in CSV_MOVED]
    for name, after in CSV_MOVED.items():
        columns.insert(columns.index(after) + 1, name)
    return tuple(columns)


CSV_COLUMNS = _csv_columns()
COMPONENT_ROW_FIELDS = ("run_id", "label", "measured_seq_len")
COMPONENT_CSV_COLUMNS = (
    *COMPONENT_ROW_FIELDS,
    *StoredComponent.model_fields,
    *StoredComponent.model_computed_fields,
)
"""components.csv's columns: the run's, then a stored component's (its ratio included)."""
EXPORT_TYPES: dict[str, Any] = {"params": str}
"""A field exported in another form than the row holds it: params as canonical JSON."""


def _result_row_model() -> type[BaseModel]:
    """results.json's row model, generated from RunRow's exported fields: each field's type
    (EXPORT_TYPES where it is written otherwise) and its doc as its description."""
    hints = get_type_hints(RunRow)
    declared: dict[str, Any] = {}
    for f in fields(RunRow):
        if f.name in EXPORTED:
            annotation = EXPORT_TYPES.get(f.name, hints[f.name])
            declared[f.name] = (annotation, Field(description=f.metadata.get("doc") or None))
    doc = "One run in results.json / results.csv: its cell, outcome, numbers and ratios."
    return create_model("ResultRow", __doc__=doc, **declared)


ResultRow = _result_row_model()


def result_row(row: RunRow) -> dict[str, Any]:
    """One flat row of results.json / results.csv: the row's exported fields as JSON values."""
    out = {name: getattr(row, name) for name in EXPORTED}
    out["params"] = canonical_json(row.params)
    out["flags"] = [asdict(f) for f in row.flags]
    out["components"] = [c.model_dump() for c in row.components]
    return out


def figures(row: RunRow) -> list[tuple[str, float | int | str | bool, str]]:
    """(name, value, doc) of every number and word results.json holds for the row, in its
    order, those measured only (None and lists left out): the run page lists them all, so a
    field added to RunRow shows there without a template of its own."""
    docs = {f.name: str(f.metadata.get("doc") or "") for f in fields(RunRow)}
    return [
        (name, value, docs[name])
        for name, value in result_row(row).items()
        if isinstance(value, float | int | str | bool) and value != ""
    ]


def components_csv(rows: Sequence[RunRow]) -> str:
    """Every model run's memory components (its limiting rank), one line each: the seed's
    per-component table with raw bytes."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COMPONENT_CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        run = {name: getattr(r, name) for name in COMPONENT_ROW_FIELDS}
        for c in r.components:
            writer.writerow({k: _csv_cell(v) for k, v in {**run, **c.model_dump()}.items()})
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
    """The pivot as CSV, for machines: a column per section field (what else varies), the rows
    field and each field that varies with it by name (seq_len, world_size) holding raw values
    (1024, not "1,024"), then one column per column value (raw numbers). The pivot page shows
    the same table with display names (baselines.pivot)."""
    table = baselines.pivot(rows, spec)
    axes, raw = _pivot_row_values(rows, spec)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*table.section_fields, *axes, *table.columns])
    for section in table.sections:
        for name, values in section.rows:
            cells = raw[(section.title, name)]
            writer.writerow([*section.values, *cells, *("" if v is None else v for v in values)])
    return buf.getvalue()


def _pivot_row_values(
    rows: Sequence[RunRow], spec: PivotSpec
) -> tuple[list[str], dict[tuple[str, str], list[Any]]]:
    """The fields a pivot row is named by (the rows field, then those beside it) and, per
    (section title, row name) of baselines.pivot, their raw values: the layout is the pivot's
    own, so every row of the table finds its values."""
    measured = [r for r in rows if getattr(r, spec.value) is not None]
    fields, _, beside = pivot_layout(measured, spec)
    axes = [spec.rows, *beside]
    raw: dict[tuple[str, str], list[Any]] = {}
    for r in rows:
        key = (section_title(r, fields), row_text(r, spec.rows, beside))
        raw[key] = [_raw_cell(axis_value(r, f)) for f in axes]
    return axes, raw


def _raw_cell(value: Any) -> Any:
    """A value as a CSV cell: numbers and words as they are, lists as canonical JSON."""
    if value is None:
        return ""
    if isinstance(value, int | float | str | bool):
        return value
    return canonical_json(value)
