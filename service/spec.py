"""The sweep spec: a base run config plus grid and zip axes, expanded into validated run configs.

The API, the CLI and the scheduler share it. Errors carry a field path (`loc`) and name the bad
cell's axis values, so the API can answer 422 with the exact place to fix.

Its parts, by concept: spec_models (what is submitted), spec_fields (field names and errors),
spec_values (what a database can hold), spec_structure (checks before expanding), spec_params
(a kernel's params), spec_limits (the service's caps), spec_expand (the cells), spec_cells (a
cell, its key, the memo). This module is the one the rest of the service imports.
"""

from __future__ import annotations

from service.core.config import RunLimits
from service.spec_cells import Cell, canonical_json, cell_key_of
from service.spec_expand import MAX_SEQ_LEN, cell_key, expand, iter_cells
from service.spec_fields import (
    MAX_ERRORS,
    NESTED,
    RUN_FIELDS,
    SPEC_FIELDS,
    SpecError,
    field_error,
    nested_axis,
    split_message,
)
from service.spec_limits import limit_checks, limit_problems
from service.spec_models import AnalysisSpec, PivotSpec, PivotValue, SweepSpec
from service.spec_params import normalize_params
from service.spec_structure import cell_count
from service.spec_values import MAX_DEPTH, MAX_JSON_INT, unstorable_values

MAX_CELLS = RunLimits.cells
"""A grid larger than this (by default; RINGLAB_MAX_CELLS) is rejected before expanding."""

__all__ = [
    "MAX_CELLS",
    "MAX_DEPTH",
    "MAX_ERRORS",
    "MAX_JSON_INT",
    "MAX_SEQ_LEN",
    "NESTED",
    "RUN_FIELDS",
    "SPEC_FIELDS",
    "AnalysisSpec",
    "Cell",
    "PivotSpec",
    "PivotValue",
    "SpecError",
    "SweepSpec",
    "canonical_json",
    "cell_count",
    "cell_key",
    "cell_key_of",
    "expand",
    "field_error",
    "iter_cells",
    "limit_checks",
    "limit_problems",
    "nested_axis",
    "normalize_params",
    "split_message",
    "unstorable_values",
]
