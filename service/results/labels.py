"""Readable labels of a sweep's rows: the kernel and only what varies within the sweep.

A row's label names its kernel, then each param and config field whose value differs between
the sweep's rows (never an unset parameter); its series label leaves out the world size (for
charts whose x axis is the world size). A param counts by what was asked for
(`given_params`): a default that expansion resolved into the config (workers.resolved) is as
if unset.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.results.rows import Flag, RunRow
from service.spec import nested_axis
from workers import resolved

LABEL_FIELDS = (
    "world_size", "parallel", "dtype", "mode", "causal", "batch_size", "num_heads",
    "num_kv_heads", "head_dim", "memory_budget_bytes", "profile",
)  # fmt: skip
"""Config fields a label shows when they vary within the sweep (after the kernel and params)."""


def given_params(config: dict[str, Any]) -> dict[str, Any]:
    """The config's params without None and without what expansion resolved from a default."""
    return resolved.as_given(
        str(config.get("kernel")),
        config.get("params") or {},
        causal=bool(config.get("causal")),
        device=str(config.get("device", "auto")),
    )


PIVOT_ROW_COPIES = ("length", "seq_len", "kernel", "world_size", "searched", "model")
"""The fields a PivotRow takes from its RunRow as they are (same name, same value)."""


@dataclass(frozen=True, slots=True)
class PivotRow:
    """What a label and a pivot read of a run (axis_value, Varying, service.results.pivot), with
    one metric: a few hundred bytes where its RunRow holds ~3 KB, for a report that pivots
    every run of a 100,000-run sweep at once. Its config holds the fields an axis can name
    (AXIS_CONFIG_FIELDS and the pivot's own), each as the run's config has it."""

    label: str
    length: int
    seq_len: int
    kernel: str
    world_size: int
    searched: bool
    model: str | None
    config: dict[str, Any]
    params: dict[str, Any]
    flags: tuple[Flag, ...]
    metric_name: str
    """The one metric it carries (a field of RunRow, service.results.pivot.PIVOT_VALUES)."""
    metric: Any

    def flags_on(self, field: str) -> list[Flag]:
        """The flags that mark `field`, as RunRow.flags_on."""
        return [f for f in self.flags if f.field == field]

    def value_of(self, name: str) -> Any:
        """Its metric `name` (ValueError for another: it carries one)."""
        if name != self.metric_name:
            raise ValueError(f"this pivot row carries {self.metric_name}, not {name}")
        return self.metric


AxisRow = RunRow | PivotRow
"""A run as a label or a pivot reads it: its whole row, or what of it a pivot reads."""


def axis_value(row: AxisRow, name: str) -> Any:
    """A row's value of a label or pivot axis: label, seq_len (the length it ran), kernel,
    model, a nested field (`training.<name>`, ...) or a config field."""
    if name == "label":
        return row.label
    if name == "seq_len":
        return row.length
    if name == "kernel":
        return row.kernel
    nested = nested_axis(name)
    if nested is not None:
        return (row.config.get(nested[0]) or {}).get(nested[1])
    if name == "model":
        return row.model
    return row.config.get(name)


def value_text(value: Any) -> str:
    """A value as a label shows it: lists as [a,b], dicts as compact sorted JSON."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def mask_text(mask: dict[str, Any]) -> str:
    """A stored mask as a label shows it: its kind and what sets it, sampled or file lengths by
    where they come from (the lengths written out follow from it and the seq_len), e.g.
    'documents(causal, lognormal mean 256 seed 0)', 'sliding_window(causal, window 4096)'."""
    given = resolved.mask_as_given(mask)
    parts = ["causal"] if given.get("causal") else []
    parts += [f"{k} {given[k]}" for k in ("window", "prefix") if k in given]
    if isinstance(sampled := given.get("sampled"), dict):
        parts.append(" ".join(f"{k} {v}" if k != "distribution" else str(v)
                              for k, v in sampled.items()))  # fmt: skip
    elif "lengths_file" in given:
        parts.append(f"file {given['lengths_file']}")
    elif "lengths" in given:
        parts.append(value_text(given["lengths"]))
    kind = str(given.get("kind"))
    return f"{kind}({', '.join(parts)})" if parts else kind


def param_text(name: str, value: Any) -> str:
    """A param's value as labels compare and show it (a mask by mask_text)."""
    return mask_text(value) if name == "mask" and isinstance(value, dict) else value_text(value)


def field_text(name: str, value: Any) -> str | None:
    """One label part; None for a value that is unset (the kernel's own choice)."""
    if value is None:
        return None
    if name == "mask":
        return f"mask={param_text(name, value)}"
    if name == "world_size":
        return f"W={value}"
    if name == "parallel":
        return f"{value}-parallel"
    if name == "causal":
        return "causal" if value else "non-causal"
    if name == "profile":  # a profiled run's times include the profiler's cost
        return "profiled" if value else None
    if name in ("dtype", "mode", "training.optimizer", "training.precision"):
        return str(value)
    if name == "model":
        return str(value)
    if name == "training.checkpointing":
        return f"checkpoint {value}"
    if name == "training.loss_chunk_tokens":
        return f"chunked loss {value}"
    return f"{name.removeprefix('training.')}={value_text(value)}"


TRAINING_FIELDS = ("optimizer", "precision", "checkpointing", "checkpoint_every",
                   "loss_chunk_tokens")  # fmt: skip
"""A model cell's training settings a label shows when they vary (as training.<name>)."""


LABEL_AXES = ("model", *LABEL_FIELDS, *(f"training.{t}" for t in TRAINING_FIELDS))
"""Everything but params a label may show, in its order."""

AXIS_CONFIG_FIELDS = frozenset({"kernel", "params", "causal", "device", "model", "training",
                                *LABEL_FIELDS})  # fmt: skip
"""The config fields a label or pivot reads whatever the pivot names: given_params' (kernel,
params, causal, device), the nested axes' objects and LABEL_FIELDS (PivotRow)."""


class Varying:
    """What differs between rows, from one pass over them: the distinct texts of every param
    and label field (a param some rows lack counts as None there)."""

    def __init__(self) -> None:
        self.rows = 0
        self.params: dict[str, set[str]] = {}
        self.ran: dict[str, set[str]] = {}  # the values that ran, resolved defaults included
        self.with_param: dict[str, int] = {}
        self.fields: dict[str, set[str]] = {f: set() for f in LABEL_AXES}

    def add(self, row: AxisRow) -> None:
        self.rows += 1
        given = given_params(row.config)  # what was asked for: a resolved default counts as unset
        for k, v in row.params.items():
            self.params.setdefault(k, set()).add(param_text(k, given.get(k)))
            self.ran.setdefault(k, set()).add(param_text(k, v))
            self.with_param[k] = self.with_param.get(k, 0) + 1
        for f, seen in self.fields.items():
            seen.add(value_text(axis_value(row, f)))

    def result(self) -> tuple[list[str], list[str]]:
        """(params, config fields) whose value differs between the rows; a differing model is
        the field `model`, a differing training setting `training.<name>`."""
        vary_params = [
            p
            for p in sorted(self.params)
            if len(self.params[p] | ({"None"} if self.with_param[p] < self.rows else set())) > 1
            or len(self.ran[p]) > 1  # what ran differs (zigzag and contiguous), asked or not
        ]
        vary_fields = [f for f in LABEL_AXES if len(self.fields[f]) > 1]
        if "model" in vary_fields:  # the model implies its heads and head size
            vary_fields = [f for f in vary_fields if f not in ("num_heads", "head_dim")]
        if any(f.startswith("training.precision") for f in vary_fields):
            vary_fields = [f for f in vary_fields if f != "dtype"]  # the precision implies it
        return vary_params, vary_fields


SCHEME_APART = frozenset({"mask", "document_lengths"})
"""Params a scheme's name leaves out: the mask is what the schemes run, not one of them."""


def scheme_text(row: RunRow, apart: frozenset[str] = SCHEME_APART) -> str:
    """The kernel with the params given beside those `apart`, declared defaults left out as
    labels leave them: 'ring · balance=ptrr', 'allgather_kv · balance=none · gather=needed'."""
    given = given_params(row.config)
    parts = [f"{k}={param_text(k, v)}" for k, v in sorted(given.items()) if k not in apart]
    return " · ".join([row.kernel, *parts])


def varying(rows: Sequence[AxisRow]) -> tuple[list[str], list[str]]:
    """(params, config fields) whose value differs between the rows (see Varying)."""
    found = Varying()
    for r in rows:
        found.add(r)
    return found.result()


def label(row: RunRow, vary_params: Sequence[str], vary_fields: Sequence[str]) -> str:
    """The kernel and only what varies within the sweep (never an unset parameter)."""
    parts = [row.kernel]
    parts += [t for p in vary_params if (t := field_text(p, row.params.get(p))) is not None]
    for f in vary_fields:
        if f == "parallel" and row.world_size == 1:
            continue  # one rank: data and sequence parallel are the same run
        if (text := field_text(f, axis_value(row, f))) is not None:
            parts.append(text)
    return " · ".join(parts)


def series_label(row: RunRow, vary_params: Sequence[str], vary_fields: Sequence[str]) -> str:
    """A label without the world size (for charts whose x axis is the world size)."""
    return label(row, vary_params, [f for f in vary_fields if f != "world_size"])


def set_labels(rows: Sequence[RunRow]) -> None:
    """Label every row with what tells it apart within these rows."""
    vp, vf = varying(rows)
    for r in rows:
        r.label = label(r, vp, vf)
        r.series = series_label(r, vp, vf)
