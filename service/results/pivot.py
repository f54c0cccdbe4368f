"""A sweep's pivot: one metric by rows x columns, one section per combination of what else
varies (service.results.report's tables, the pivot API and pivot.csv).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from service.results.labels import AxisRow, PivotRow, axis_value, field_text, value_text, varying
from service.spec import AnalysisSpec, PivotSpec
from service.units import natural_key

PIVOT_VALUES: dict[str, str] = {
    "median_s": "time",
    "tokens_per_s": "tokens/s",
    "tflops_per_s": "TFLOP/s",
    "peak_memory_bytes": "peak memory per rank",
    "memory_per_token_bytes": "memory per token",
    "max_seq_len": "max tokens",
    "speedup": "speedup",
    "memory_ratio": "memory ratio",
    "max_len_gain": "max-length gain",
    "efficiency": "scaling efficiency",
}


@dataclass(frozen=True)
class PivotSection:
    """One block of a pivot: the rows sharing the values of what else varies (its title)."""

    title: str
    """What this block's rows share, e.g. "mode forward"; "" when nothing else varies."""
    values: list[str]
    """The value of each of the pivot's section_fields ("" where unset)."""
    rows: list[tuple[str, list[float | None]]]
    flags: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    """(row index, column index) -> the flag codes on the value shown there (views.Flag)."""


@dataclass(frozen=True)
class Pivot:
    """rows x columns of one metric, one section per combination of whatever else varies (so
    every cell of a row is the same kind of run); None where no run falls in a cell."""

    value: str
    row_header: str
    """What the rows are, e.g. "seq len"."""
    column_header: str
    """What the columns are, e.g. "kernel x world size x parallel"."""
    columns: list[str]
    sections: list[PivotSection]
    section_fields: list[str] = field(default_factory=list)
    """The fields a section title names (what else varies), in order."""

    @property
    def rows(self) -> list[tuple[str, list[float | None]]]:
        """Every section's rows, each named with its section's title first."""
        return [
            (f"{s.title} · {name}" if s.title else name, values)
            for s in self.sections
            for name, values in s.rows
        ]


def _metric(row: AxisRow, name: str) -> Any:
    """The row's metric `name` (a PivotRow carries one)."""
    return row.value_of(name) if isinstance(row, PivotRow) else getattr(row, name)


def _sort_key(value: Any) -> tuple[int, Any]:
    """Numbers first, in numeric order; then text with its numbers read as numbers ("W=4"
    before "W=16"), a list of numbers element by element ([1,2] before [1,2,4])."""
    if isinstance(value, int | float):
        return (0, value)
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return (1, ((0, "["), *((1, float(v)) for v in value)))  # sorts as its text would
    return (1, natural_key(value_text(value)))


def default_pivot(rows: Sequence[AxisRow]) -> PivotSpec | None:
    """Time per length (rows) x world size and parallel mode (columns), where those vary; the
    kernel joins the columns when kernels run at different (world size, parallel) pairs (dense
    at W=1 and W=2 data-parallel, ring at W=2: see pivot), so a row is never half empty.
    Whatever else varies (mode, params, ...) makes the pivot's sections."""
    bench = [r for r in rows if not r.searched]
    if len({r.seq_len for r in bench}) < 2:
        return None
    columns = [f for f in ("world_size", "parallel") if len({r.config.get(f) for r in bench}) > 1]
    return PivotSpec(rows="seq_len", columns=columns or ["label"], value="median_s")


def pivot_spec(spec: AnalysisSpec | None, rows: Sequence[AxisRow]) -> PivotSpec | None:
    """The sweep's own pivot, else the default one (None when nothing is worth pivoting)."""
    if spec is not None and spec.pivot is not None:
        return spec.pivot
    return default_pivot(rows)


def _column_text(row: AxisRow, columns: Sequence[str]) -> str:
    """A run's column in a pivot: "dense · W=2 · data-parallel"; one rank has no parallel mode
    ("W=1", also where the world size is not a column)."""
    parts = []
    for c in columns:
        value = axis_value(row, c)
        if c == "label" or c == "kernel":
            parts.append(str(value))
        elif c == "parallel" and row.world_size == 1:
            if "world_size" not in columns:
                parts.append("W=1")
        elif (t := field_text(c.removeprefix("params."), value)) is not None:
            parts.append(t)
    return " · ".join(parts) or "-"


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return value_text(value)


def _axis_title(name: str) -> str:
    return {"world_size": "world size", "seq_len": "seq len"}.get(
        name, name.removeprefix("params.").replace("_", " ")
    )


def _section_fields(rows: Sequence[AxisRow], used: set[str]) -> list[str]:
    """What varies besides the pivot's rows and columns: the kernel, params, other fields."""
    if "label" in used:
        return []
    vp, vf = varying(rows)
    kernel = ["kernel"] if len({r.kernel for r in rows}) > 1 else []
    fields = [*kernel, *(f"params.{p}" for p in vp), *vf]
    out = [f for f in fields if f not in used]
    if "world_size" in used:  # "W=1" stands for both
        out = [f for f in out if f != "parallel"]
    return out


def _section_value(row: AxisRow, name: str) -> str:
    value = axis_value(row, name)
    if value is None or (name == "parallel" and row.world_size == 1):
        return ""
    return value_text(value)


def section_title(row: AxisRow, fields: Sequence[str]) -> str:
    parts = []
    for f in fields:
        if f == "parallel" and row.world_size == 1:
            continue
        value = axis_value(row, f)
        if f == "world_size":
            parts.append(f"W={value}")
        elif value is not None:
            parts.append(f"{_axis_title(f)} {value_text(value)}")
    return " · ".join(parts)


def _splits_columns(rows: Sequence[AxisRow], name: str, columns: Sequence[str]) -> bool:
    """Whether the runs of each value of `name` fill different columns (dense at W=1 and W=2
    data-parallel, ring at W=2 sequence-parallel): then `name` belongs in the columns, or
    every section would be half empty."""
    filled: dict[str, set[str]] = {}
    for r in rows:
        filled.setdefault(value_text(axis_value(r, name)), set()).add(_column_text(r, columns))
    return len({frozenset(v) for v in filled.values()}) > 1


def _together(rows: Sequence[AxisRow], a: str, b: str) -> bool:
    """Whether fields a and b vary together over the rows: each takes two values or more, and
    one fixes the other (a zip of them; a param and the kernel it belongs to) or a table of a
    against b would fill half its cells or fewer (two params of one kernel each: each run sets
    one, the other unset): a mostly empty diagonal."""
    pairs = {(value_text(axis_value(r, a)), value_text(axis_value(r, b))) for r in rows}
    firsts, seconds = {x for x, _ in pairs}, {y for _, y in pairs}
    if len(firsts) < 2 or len(seconds) < 2:
        return False
    fixed = len(pairs) in (len(firsts), len(seconds))
    return fixed or 2 * len(pairs) <= len(firsts) * len(seconds)


def row_text(row: AxisRow, name: str, beside: Sequence[str]) -> str:
    """A pivot row's name: the rows field's value, then each field that varies with it
    ("1,024 · W=2"); an unset value is left out ("-" when all are)."""
    value = axis_value(row, name)
    parts = [] if value is None else [_shown(value)]
    parts += [t for b in beside if (t := _column_text(row, [b])) != "-"]
    return " · ".join(parts) or "-"


def pivot_layout(measured: Sequence[AxisRow], spec: PivotSpec) -> tuple[list[str], ...]:
    """(section fields, columns, fields beside the rows): what else varies but fills
    different columns per value joins the columns; a column field that varies together with
    the rows field moves beside it, on the rows' side."""
    fields = _section_fields(measured, {spec.rows, *spec.columns})
    columns = list(spec.columns)
    for f in list(fields):
        if _splits_columns(measured, f, columns):
            fields.remove(f)
            columns.insert(0, f)
    beside = [c for c in columns if _together(measured, spec.rows, c)]
    return fields, [c for c in columns if c not in beside], beside


def pivot(rows: Sequence[AxisRow], spec: PivotSpec) -> Pivot:
    """The metric spec.value for every (row value, column values) pair of the rows, one
    section per combination of what else varies (so two runs never share one cell); what else
    varies but fills different columns per value (the kernel of a dense-vs-ring
    sweep) joins the columns instead, and a column field varying together with the rows field
    joins the rows (pivot_layout): never a mostly empty diagonal."""
    measured = [r for r in rows if _metric(r, spec.value) is not None]
    fields, columns, beside = pivot_layout(measured, spec)
    cells: dict[tuple[str, Any], dict[str, Any]] = {}
    row_keys: dict[tuple[str, Any], tuple[Any, ...]] = {}
    flagged: dict[tuple[str, Any], dict[str, list[str]]] = {}
    col_keys: dict[str, tuple[Any, ...]] = {}
    sec_keys: dict[str, tuple[Any, ...]] = {}
    sec_values: dict[str, list[str]] = {}
    for r in rows:
        title = section_title(r, fields)
        sec_keys[title] = tuple(_sort_key(axis_value(r, f)) for f in fields)
        sec_values[title] = [_section_value(r, f) for f in fields]
        ctext = _column_text(r, columns) if columns else PIVOT_VALUES[spec.value]
        col_keys[ctext] = tuple(_sort_key(axis_value(r, c)) for c in columns)
        key = (title, row_text(r, spec.rows, beside))
        row_keys[key] = tuple(_sort_key(axis_value(r, f)) for f in (spec.rows, *beside))
        cells.setdefault(key, {})[ctext] = _metric(r, spec.value)
        codes = [f.code for f in r.flags_on(spec.value)]
        if codes:
            flagged.setdefault(key, {})[ctext] = codes
    filled = {c for values in cells.values() for c, v in values.items() if v is not None}
    ordered = sorted(filled, key=lambda c: col_keys[c])  # a column with nothing measured: gone
    sections = []
    for title in sorted(sec_keys, key=lambda t: sec_keys[t]):
        keys = sorted((k for k in cells if k[0] == title), key=lambda k: row_keys[k])
        body = [(k[1], [cells[k].get(c) for c in ordered]) for k in keys]
        if all(v is None for _, values in body for v in values):
            continue  # nothing measured here (the baselines of a pivot of speedups)
        marks = {
            (i, j): flagged[k][c]
            for i, k in enumerate(keys)
            for j, c in enumerate(ordered)
            if c in flagged.get(k, {})
        }
        values = sec_values[title]
        sections.append(PivotSection(title=title, values=values, rows=body, flags=marks))
    return Pivot(
        value=spec.value,
        row_header=" · ".join(_axis_title(f) for f in (spec.rows, *beside)),
        column_header=" x ".join(_axis_title(c) for c in columns) or PIVOT_VALUES[spec.value],
        columns=ordered,
        sections=sections,
        section_fields=fields,
    )
