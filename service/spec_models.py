"""The sweep spec as submitted: a base run config plus grid and zip axes, a search block, and
the analysis (baselines, pivot) its report derives."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.spec_fields import axis_name, shown_key
from service.spec_params import normalize_params
from workers.config import SearchConfig

PivotValue = Literal[
    "median_s",
    "tokens_per_s",
    "tflops_per_s",
    "peak_memory_bytes",
    "memory_per_token_bytes",
    "max_seq_len",
    "speedup",
    "memory_ratio",
    "max_len_gain",
    "efficiency",
]


def _kernel_baseline(value: dict[str, Any]) -> dict[str, Any]:
    """A baseline that is another kernel: {kernel: K, params: {...}} (plus other fields), its
    params normalized as a cell of K stores them (defaults filled), so that it matches."""
    kernel, params = value.get("kernel"), value["params"]
    if kernel is None:
        raise ValueError("params: a baseline names whole params only with its kernel")
    normalized, errors = normalize_params(kernel, params)
    if normalized is None:
        path, reason = errors[0]
        # escaped: pydantic cannot carry a message holding a key's lone surrogate (a 500)
        raise ValueError(shown_key(f"{'.'.join(map(str, path))}: {reason}"))
    return {**value, "params": normalized}


class PivotSpec(BaseModel):
    """A pivot table: one metric for every (rows value, columns values) pair."""

    model_config = ConfigDict(extra="forbid")

    rows: str = Field("seq_len", description="A run config field, params.<name> or label.")
    columns: list[str] = Field(
        default_factory=lambda: ["world_size", "parallel"], min_length=1, max_length=4
    )
    value: PivotValue = "median_s"

    @field_validator("rows")
    @classmethod
    def _rows(cls, value: str) -> str:
        return value if value == "label" else axis_name(value)

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: list[str]) -> list[str]:
        return [v if v == "label" else axis_name(v) for v in value]


class AnalysisSpec(BaseModel):
    """What each cell is compared against, and how the report pivots the results."""

    model_config = ConfigDict(extra="forbid")

    baseline: dict[str, Any] | None = Field(
        None,
        description="Fields (or params.<name>) that turn a cell into its baseline, e.g. "
        "{world_size: 1}, {params.dilation_rates: [1]}, or another kernel with its params "
        "{kernel: ring, params: {layout: zigzag}}. Default: world size 1 of the same cell for "
        "W>1, dense of the same shape for sparse/dilated kernels.",
    )
    scaling: Literal["strong", "weak"] = Field(
        "strong",
        description="strong: the baseline does the same global work; weak: one rank's share.",
    )
    pivot: PivotSpec | None = None

    @field_validator("baseline")
    @classmethod
    def _baseline(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("name at least one field that the baseline changes")
        if "params" in value:  # another kernel: its whole params, as its cells store them
            value = _kernel_baseline(value)
        for key in value:
            if key != "params":
                axis_name(key)
        world = value.get("world_size")
        if "world_size" in value and (
            isinstance(world, bool) or not isinstance(world, int) or world < 1
        ):
            raise ValueError(f"world_size: expected a positive integer, got {world!r}")
        return value


class SweepSpec(BaseModel):
    """What a user submits: `base` run config, `grid` axes (cartesian) and `zip` axes (lockstep)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1, max_length=200, description="Shown on every page and atop report.md."
    )
    kind: Literal["benchmark", "max_seq_len", "correctness"] = Field(
        "benchmark",
        description="benchmark: time each cell; max_seq_len: search each cell's longest length; "
        "correctness: every cell runs with correctness_check=true.",
    )
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="A partial run config shared by every cell; may hold a run-level `mask` "
        "(stored as `causal` and `params.mask`: see A run's mask).",
    )
    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Axis -> values; the cells are their cartesian product. Axes are run config "
        "fields, a run-level `mask`, `params.<name>`, `model.<name>`, `training.<name>`, or "
        "`params` / `model` / `training` with whole objects as values (merged over the base's; a "
        "`params` axis zipped with `kernel` gives each kernel its own params).",
    )
    zip: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Axis -> values of equal length that vary together (one extra grid dimension).",
    )
    search: SearchConfig | None = Field(
        None,
        description="Maximum sequence length search (start, max, granularity): required for "
        "kind max_seq_len, refused for the other kinds.",
    )
    analysis: AnalysisSpec | None = Field(
        None, description="Baselines, ratios and the pivot the report and dashboard derive."
    )
