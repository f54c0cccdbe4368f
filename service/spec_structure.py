"""What a sweep spec must be before it is expanded: known field and axis names, non-empty axes
of equal zip lengths, a search block exactly for a max_seq_len sweep, at most the allowed
number of cells."""

from __future__ import annotations

import math
from typing import Any

from service.core.config import RunLimits
from service.spec_fields import NESTED, SPEC_FIELDS, SpecError, err, nested_axis
from service.spec_models import SweepSpec
from workers.config import ModelConfig, TrainingConfig


def cell_count(spec: SweepSpec) -> int:
    """How many cells the spec expands into (before validation)."""
    grid = math.prod(len(v) for v in spec.grid.values())
    zipped = len(next(iter(spec.zip.values()))) if spec.zip else 1
    return grid * zipped


def _check_axis(where: str, axis: str) -> dict[str, Any] | None:
    head, dot, name = axis.partition(".")
    if dot and head in NESTED:
        if not name.isidentifier():
            return err((where, axis), f"{name!r} is not a field name of {head}")
        if head != "params":
            fields = (ModelConfig if head == "model" else TrainingConfig).model_fields
            if name not in fields:
                valid = ", ".join(sorted(fields))
                return err((where, axis), f"unknown field of {head}: {name!r}; valid: {valid}")
        return None
    if axis == "search":
        return err((where, axis), "search is not an axis; use the sweep's search block")
    if axis not in SPEC_FIELDS:
        valid = ", ".join(sorted(SPEC_FIELDS - set(NESTED)))
        return err(
            (where, axis),
            f"unknown axis {axis!r}; valid: {valid}, or params.<name>, model.<name>, "
            "training.<name>",
        )
    return None


def _base_errors(base: dict[str, Any]) -> list[dict[str, Any]]:
    """A base key that is no run config field (search included: it belongs at the top)."""
    errors = []
    for key in base:
        if key == "search":
            errors.append(err(("base", key), "put the search block at the top level of the sweep"))
        elif key not in SPEC_FIELDS:
            errors.append(
                err(("base", key), f"unknown run config field {key!r}", "extra_forbidden")
            )
    return errors


def _axis_errors(spec: SweepSpec) -> list[dict[str, Any]]:
    """Axis names that are no field, empty axes, and axes in both grid and zip."""
    errors = []
    for where, axes in (("grid", spec.grid), ("zip", spec.zip)):
        for axis, values in axes.items():
            problem = _check_axis(where, axis)
            if problem:
                errors.append(problem)
            elif not values:
                errors.append(err((where, axis), "an axis needs at least one value"))
    for axis in spec.grid.keys() & spec.zip.keys():
        errors.append(err(("zip", axis), f"axis {axis!r} is in both grid and zip"))
    return errors


def _nested_axis_errors(spec: SweepSpec) -> list[dict[str, Any]]:
    """A nested axis (model.d_model) whose field the whole object's axis (model) sets too."""
    errors = []
    for where, axes in (("grid", spec.grid), ("zip", spec.zip)):
        for axis in axes:
            nested = nested_axis(axis)
            whole = [*spec.grid.get(nested[0], []), *spec.zip.get(nested[0], [])] if nested else []
            if nested and any(isinstance(v, dict) and nested[1] in v for v in whole):
                errors.append(
                    err(
                        (where, axis),
                        f"{nested[1]} is also set by the {nested[0]} axis's objects; set it in "
                        "one place",
                    )
                )
    return errors


def _zip_length_errors(zipped: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """A zip axis whose length is not the first zip axis's."""
    if not zipped:
        return []
    errors = []
    first_axis, first = next(iter(zipped.items()))
    for axis, values in zipped.items():
        if len(values) != len(first):
            errors.append(
                err(
                    ("zip", axis),
                    f"zip axes vary together and need equal lengths: {axis!r} has "
                    f"{len(values)}, {first_axis!r} has {len(first)}",
                )
            )
    return errors


def _search_errors(spec: SweepSpec) -> list[dict[str, Any]]:
    """A max_seq_len sweep sets no seq_len and has a search block; no other kind has one."""
    if spec.kind != "max_seq_len":
        if spec.search is None:
            return []
        return [err(("search",), f"a search block needs kind max_seq_len, not {spec.kind}")]
    errors = [
        err(
            (where, "seq_len"),
            "a max_seq_len sweep searches seq_len; set search.start and search.max",
        )
        for where, axes in (("base", spec.base), ("grid", spec.grid), ("zip", spec.zip))
        if "seq_len" in axes
    ]
    if spec.search is None:  # no silent default: a search up to 16M tokens is rarely meant
        errors.append(
            err(
                ("search",),
                "a max_seq_len sweep needs a search block (start, max, granularity), e.g. "
                "search: {start: 1024, max: 65536, granularity: 1024}",
                "missing",
            )
        )
    return errors


def check_structure(spec: SweepSpec, limits: RunLimits) -> None:
    """Field names, axis shapes and the cell count: everything checked before expanding."""
    errors = [
        *_base_errors(spec.base),
        *_axis_errors(spec),
        *_nested_axis_errors(spec),
        *_zip_length_errors(spec.zip),
        *_search_errors(spec),
    ]
    if errors:
        raise SpecError(errors)
    n = cell_count(spec)
    if n > limits.cells:
        raise SpecError(
            [
                err(
                    ("grid",),
                    f"the sweep has {n:,} cells; at most {limits.cells:,} are allowed "
                    "(RINGLAB_MAX_CELLS)",
                )
            ]
        )
