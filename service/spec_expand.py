"""A sweep spec expanded into validated cells: each cell built from the base and its axis
values, checked in full or from the memo (service.spec_cells), every error mapped back to
where the user wrote the value."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import ValidationError

from attention.errors import ParamError
from service.core.config import RunLimits
from service.spec_cells import Cell, CellMemo, all_plain, cell_key_of, model_checks
from service.spec_fields import (
    MAX_ERRORS,
    NESTED,
    RUN_FIELDS,
    Loc,
    SpecError,
    err,
    field_error,
    nested_axis,
    split_message,
)
from service.spec_limits import limit_checks, limit_problems
from service.spec_mask import RUN_MASK, apply_document_lengths, apply_run_mask, lengths_as_mask
from service.spec_models import SweepSpec
from service.spec_params import ParamsCheck, normalize_params
from service.spec_structure import check_structure
from workers import resolved
from workers.config import RunConfig

MAX_SEQ_LEN = 2**63 - 1
"""seq_len is a 64-bit column."""

Position = dict[str, tuple[str, int]]


def in_params(
    typed: tuple[tuple[str, ...], str] | None, raw: dict[str, Any]
) -> tuple[tuple[str, ...], str] | None:
    """A kernel's own field error (mask.lengths, balance: raised by checks that see the run's
    length) placed under params, where the user wrote it; any other unchanged."""
    if typed is None or typed[0][0] in RUN_FIELDS:
        return typed
    params = raw.get("params")
    if isinstance(params, dict) and typed[0][0] in params:
        return ("params", *typed[0]), typed[1]
    return typed


def cell_key(config: RunConfig) -> str:
    """sha256 of the normalized run config: identical cells get identical keys."""
    return cell_key_of(config.model_dump(mode="json"))


SHOWN_VALUES = 5
"""How many of the values a grouped error breaks it lists (the count says how many cells)."""
_HOLE = "\x00"
"""Where a grouped error's message held the value of its cell (no message holds NUL: a spec
with one is refused before expanding)."""


@dataclasses.dataclass
class _Group:
    """The cells one cause breaks: the error (updated in place), the axis whose values it
    lists, its message with the value's place marked, the values (repr) and the cells."""

    error: dict[str, Any]
    axis: str
    template: str
    values: dict[str, None]  # in the order met
    cells: int = 1


class _ByCause:
    """Errors located at one axis's value whose message names the value of another axis of
    the cell ('1024 must be divisible by world_size 3' at seq_len 1024): when the other value breaks
    cells of several values of the first axis, one error at the cause (world_size 3) lists them
    and counts the cells ('seq_len must be divisible by world_size 3 in 3 cells (seq_len=1024, 2048,
    4096)'), not one error per value. `locate` gives where an axis's value of the current cell
    was written."""

    def __init__(self, locate: Callable[[str], Loc]) -> None:
        self.locate = locate
        self.groups: dict[tuple[Loc, str, str], _Group] = {}

    def add(
        self, loc: Loc, msg: str, axes: dict[str, Any], kind: str, errors: list[dict[str, Any]]
    ) -> bool:
        """Count the error into its cause's group (appending it to `errors` when new); False
        when the error names no other axis's value (the caller records it as it is)."""
        if len(loc) != 3 or loc[1] not in axes:
            return False
        axis = str(loc[1])
        cause = next((b for b, v in axes.items() if b != axis and _names(msg, b, v)), None)
        if cause is None:
            return False
        shown = re.escape(str(axes[axis]))
        template, n = re.subn(rf"(?<![\w.]){shown}(?![\w.])", _HOLE, msg, count=1)
        if not n:
            return False
        key = (self.locate(cause), template, kind)
        group = self.groups.get(key)
        if group is None:
            where = ", ".join(f"{k}={v!r}" for k, v in axes.items())
            error = err(loc, f"{msg} (cell {where})", kind)
            errors.append(error)
            self.groups[key] = _Group(error, axis, template, {repr(axes[axis]): None})
            return True
        group.cells += 1
        group.values.setdefault(repr(axes[axis]))
        if len(group.values) > 1:  # the cause, not one value of this axis, breaks them
            listed = ", ".join(itertools.islice(group.values, SHOWN_VALUES))
            more = (
                f", ... {len(group.values) - SHOWN_VALUES} more"
                if len(group.values) > SHOWN_VALUES
                else ""
            )
            reason = template.replace(_HOLE, axis)
            group.error["loc"] = list(key[0])
            group.error["msg"] = f"{reason} in {group.cells} cells ({axis}={listed}{more})"
        return True


def _names(msg: str, axis: str, value: Any) -> bool:
    """Whether `msg` names this value of the axis ('world_size 3', not 'world_size 32')."""
    return (
        re.search(rf"(?<![\w.]){re.escape(axis)} {re.escape(str(value))}(?![\w.])", msg) is not None
    )


class _Expander:
    """Builds and validates cells, mapping every error back to where the user wrote the value."""

    def __init__(self, spec: SweepSpec, limits: RunLimits) -> None:
        self.spec = spec
        self.limits = limits
        # every axis once, grid axes first: (name, grid|zip, values)
        self.axes = [(a, "grid", v) for a, v in spec.grid.items()]
        self.axes += [(a, "zip", v) for a, v in spec.zip.items()]
        self.zip_len = len(next(iter(spec.zip.values()))) if spec.zip else 1
        self.errors: list[dict[str, Any]] = []
        self.params_cache: dict[tuple[Any, ...], ParamsCheck] = {}
        self.reported: set[tuple[Loc, str]] = set()
        self.idx: tuple[int, ...] = ()  # the cell being validated
        self.run_mask = False  # whether its params.mask was written as a run-level mask
        self.from_lengths = False  # whether its params.mask was written as document_lengths
        self.by_cause = _ByCause(lambda axis: self.locate(self.position(self.idx), (axis,)))
        # _check_structure refuses a max_seq_len sweep without its search block
        self.search = (
            spec.search.model_dump()
            if spec.kind == "max_seq_len" and spec.search is not None
            else None
        )

    def indices(self) -> Iterator[tuple[int, ...]]:
        """For each cell: the index of its value on every axis (zip axes share one index)."""
        zips = len(self.spec.zip)
        ranges = [range(len(v)) for v in self.spec.grid.values()]
        for combo in itertools.product(*ranges):
            for z in range(self.zip_len):
                yield combo + (z,) * zips

    def position(self, idx: tuple[int, ...]) -> Position:
        """axis -> (grid|zip, index of the value): where each axis value of a cell was written."""
        return {name: (where, i) for (name, where, _), i in zip(self.axes, idx, strict=True)}

    def locate(self, pos: Position, path: tuple[str | int, ...]) -> Loc:
        """Where the user wrote the value at `path` (('seq_len',), ('params', 'block_size')).

        A run config field the spec leaves out (missing, or refused at its default) is named
        where it would be written: ('base', field, ...). The params.mask of a cell whose mask
        was written at run level is named there (mask, mask.lengths), and so is a causal that
        only the mask set; one written as params.document_lengths is named there.
        """
        if self.run_mask and tuple(path[:2]) == ("params", "mask"):
            path = (RUN_MASK, *path[2:])
        elif self.from_lengths and tuple(path[:2]) == ("params", "mask"):
            path = ("params", "document_lengths")
        elif self.run_mask and tuple(path) == ("causal",) and "causal" not in pos:
            path = path if "causal" in self.spec.base else (RUN_MASK,)
        head = str(path[0])
        if head in NESTED and len(path) > 1:
            axis = f"{head}.{path[1]}"
            if axis in pos:
                where, i = pos[axis]
                return (where, axis, i, *path[2:])
            if head in pos and self._sets(head, pos[head], path[1]):  # a whole object's field
                where, i = pos[head]
                return (where, head, i, *path[1:])
            given = self.spec.base.get(head)
            if isinstance(given, dict) and path[1] in given:
                return ("base", *path)
            if head in pos:  # a whole params / model / training object on an axis
                where, i = pos[head]
                return (where, head, i, *path[1:])
            if head != "params":
                return ("base", *path)
            if "kernel" in pos or "kernel" in self.spec.base:  # params are the kernel's defaults
                return self.locate(pos, ("kernel",))
            return ("base", "params")
        if head in pos:
            where, i = pos[head]
            return (where, head, i, *path[1:])
        if head in self.spec.base:
            return ("base", *path)
        if head == "seq_len" and self.search is not None:
            return ("search", "start")
        if head in RUN_FIELDS:
            return ("base", *path)
        return ("base",)

    def _sets(self, axis: str, at: tuple[str, int], name: Any) -> bool:
        """Whether the whole object that `axis` holds at `at` (grid|zip, index) sets `name`."""
        value = (self.spec.grid if at[0] == "grid" else self.spec.zip)[axis][at[1]]
        return isinstance(value, dict) and name in value

    def blame(self, pos: Position, msg: str) -> Loc:
        """For a whole-config error without a field prefix: the first axis or field it names."""
        for axis in pos:
            if axis in msg or axis.removeprefix("params.") in msg:
                return self.locate(pos, tuple(axis.split(".", 1)))
        for field in self.spec.base:
            if field in msg:
                return ("base", field)
        return ("base",)

    def add(self, loc: Loc, msg: str, axes: dict[str, Any], kind: str = "value_error") -> None:
        """Record an error once per (place, reason), naming the first cell that hit it; one
        that another axis's value causes in many cells, once for that value (_ByCause)."""
        if self.by_cause.add(loc, msg, axes, kind, self.errors):
            return
        if (loc, msg) in self.reported:
            return
        self.reported.add((loc, msg))
        where = ", ".join(f"{k}={v!r}" for k, v in axes.items())
        self.errors.append(err(loc, f"{msg} (cell {where})" if axes else msg, kind))

    def build(self, idx: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The raw (unvalidated) run config of one cell and its axis values."""
        axes = {name: values[i] for (name, _, values), i in zip(self.axes, idx, strict=True)}
        raw = dict(self.spec.base)
        raw.setdefault("params", {})
        for head in NESTED:  # copies: an axis value never changes the base another cell reads
            if isinstance(raw.get(head), dict):
                raw[head] = dict(raw[head])
        for axis, value in axes.items():
            nested = nested_axis(axis)
            if axis in NESTED and isinstance(value, dict):  # a whole params / model / training
                base_obj = raw.get(axis)
                raw[axis] = {**(base_obj if isinstance(base_obj, dict) else {}), **value}
                continue
            if nested is None:
                raw[axis] = value
                continue
            head, name = nested
            if head not in raw or raw[head] is None:
                raw[head] = {}
            if isinstance(raw[head], dict):
                raw[head][name] = value
        if self.search is not None:
            raw["search"] = self.search
            raw["seq_len"] = self.search["start"]
        if self.spec.kind == "correctness":
            raw.setdefault("correctness_check", True)
        return raw, axes

    def check_params(self, raw: dict[str, Any], idx: tuple[int, ...], axes: dict[str, Any]) -> bool:
        """Validate kernel and params (cached per distinct pair); normalize raw['params'],
        after a run-level mask is moved into them and causal, and document_lengths into a
        documents mask (service.spec_mask)."""
        self.run_mask = RUN_MASK in raw
        self.from_lengths = False
        for path, msg in apply_run_mask(raw):
            self.add(self.locate(self.position(idx), path), msg, axes)
            return False
        self.from_lengths = lengths_as_mask(raw)
        for path, msg in apply_document_lengths(raw):
            self.add(self.locate(self.position(idx), path), msg, axes)
            return False
        kernel, params = raw.get("kernel"), raw["params"]
        if kernel is None:
            return True  # RunConfig reports the missing field
        # kernel and params come from base plus these axes: their indices identify the pair.
        key = tuple(
            i
            for (name, _, _), i in zip(self.axes, idx, strict=True)
            if name in ("kernel", "params", RUN_MASK) or name.startswith("params.")
        )
        cached: tuple[Any, ...] = key
        if self.from_lengths:  # the documents mask holds the cell's causal, set apart
            cached = (*key, raw["params"]["mask"]["causal"])
        if resolved.holds_unexpanded_mask(params):  # its lengths depend on the seq_len
            cached = (*cached, repr(raw.get("seq_len")))
        if cached not in self.params_cache:
            self.params_cache[cached] = self.expanded_params(kernel, params, raw.get("seq_len"))
        normalized, problems = self.params_cache[cached]
        for path, msg in problems:
            self.add(self.locate(self.position(idx), path), msg, axes)
        if normalized is None:
            return False
        raw["params"] = normalized
        return True

    def expanded_params(self, kernel: Any, params: Any, seq_len: Any) -> ParamsCheck:
        """normalize_params of `params` with a sampled or file mask written out as its lengths
        at `seq_len` (workers.resolved.expanded_masks), so the stored config says what ran."""
        if self.search is not None and resolved.fixes_length(params):
            reason = (
                "packed documents fix the sequence length, which a max_seq_len search varies; "
                "search without a documents mask"
            )
            return None, [(("params", "mask"), reason)]
        try:
            params = resolved.expanded_masks(params, seq_len)
        except ParamError as e:
            return None, [(e.path, e.reason)]
        return normalize_params(kernel, params)

    def validate(
        self, raw: dict[str, Any], idx: tuple[int, ...], axes: dict[str, Any]
    ) -> Cell | None:
        """One cell as a RunConfig, or None after recording where and why it is invalid."""
        if self.spec.kind == "correctness" and raw["correctness_check"] is not True:
            self.add(
                self.locate(self.position(idx), ("correctness_check",)),
                "a correctness sweep checks every cell; leave correctness_check true",
                axes,
            )
            return None
        if not self.check_params(raw, idx, axes):
            return None
        try:
            config = RunConfig.model_validate(raw, strict=True)
        except ValidationError as e:
            pos = self.position(idx)
            for d in e.errors():
                msg = d["msg"].removeprefix("Value error, ")
                loc = tuple(d["loc"])
                typed = in_params(field_error(d), raw)
                if loc and loc[-1] in NESTED:  # a sub-model's own field (model.d_model)
                    head, sep, reason = msg.partition(": ")
                    if typed is not None:
                        loc, msg = (*loc, *typed[0]), typed[1]
                    elif sep and head.isidentifier():
                        loc, msg = (*loc, head), reason
                if loc:
                    target = self.locate(pos, loc)
                elif typed is not None:
                    target, msg = self.locate(pos, typed[0]), typed[1]
                elif (split := split_message(msg)) is not None:
                    target, msg = self.locate(pos, split[0]), split[1]
                else:
                    target = self.blame(pos, msg)
                self.add(target, msg, axes, d["type"])
            return None
        if config.seq_len > MAX_SEQ_LEN:
            loc = self.locate(self.position(idx), ("seq_len",))
            self.add(loc, f"must be <= {MAX_SEQ_LEN}", axes)
            return None
        if problems := limit_problems(config, self.limits):
            for path, msg in problems:
                where = path if path[0] == "search" else self.locate(self.position(idx), path)
                self.add(where, msg, axes)
            return None
        config = resolved.resolve(config)  # the layout, plan, inner params that will run
        config_json = config.model_dump(mode="json")
        try:
            key = cell_key_of(config_json)
        except ValueError:
            bad = [
                k for k, v in config_json.items() if isinstance(v, float) and not math.isfinite(v)
            ]
            loc = self.locate(self.position(idx), (bad[0],)) if bad else ("base",)
            self.add(loc, "must be finite", axes)
            return None
        return Cell(config, config_json, key, axes)

    def memo(self) -> CellMemo | None:
        """The memo of checked parts (service.spec_cells), for a sweep of attention cells."""
        names = [name for name, _, _ in self.axes]
        base = self.spec.base
        if not all_plain(names) or {"workload", "model", "training"} & base.keys():
            return None
        given = [base.get("params"), base.get(RUN_MASK), [v for _, _, v in self.axes]]
        if resolved.holds_unexpanded_mask(given):
            return None  # the params follow the seq_len: every cell is validated in full
        limits = self.limits
        checks = [
            *model_checks(),
            *limit_checks(limits),
            lambda config: config.seq_len <= MAX_SEQ_LEN,
        ]
        if self.spec.kind == "correctness":
            checks.append(lambda config: config.correctness_check)
        return CellMemo([(n, v) for n, _, v in self.axes], checks)

    def cells(self) -> Iterator[Cell]:
        """Each valid cell as it is validated; once every cell has been seen, SpecError if any
        was invalid. Only the cells' keys are kept (to find duplicates), never the cells.

        A cell whose every part was checked in an earlier cell comes from the memo; any other
        is built and validated in full (and teaches the memo its parts)."""
        seen: dict[str, tuple[int, ...]] = {}
        memo = self.memo()
        for idx in self.indices():
            if len(self.errors) >= MAX_ERRORS:
                break
            cell = memo.cell(idx) if memo is not None else None  # valid by construction
            if cell is None:
                raw, axes = self.build(idx)
                self.idx = idx
                cell = self.validate(raw, idx, axes)
                if cell is None:
                    continue
                if memo is not None:
                    memo.learn(idx, cell)
            if cell.cell_key in seen:
                first_axes = self.build(seen[cell.cell_key])[1]
                first = ", ".join(f"{k}={v!r}" for k, v in first_axes.items())
                where = self.axes[0][1] if self.axes else "base"
                msg = f"duplicate cell: same run config as the cell {first}"
                self.add((where,), msg, cell.axes)
                continue
            seen[cell.cell_key] = idx
            if not self.errors:  # after the first error only errors are of use
                yield cell
        if self.errors:
            raise SpecError(self.errors[:MAX_ERRORS])


def iter_cells(spec: SweepSpec, limits: RunLimits | None = None) -> Iterator[Cell]:
    """The sweep's cells one at a time as validated RunConfigs; a SpecError (with field paths)
    once the expansion is over if any cell was invalid, after the valid ones before it were
    yielded: a caller that stores them does so in a transaction it rolls back then. `limits`:
    the service's caps (default: RunLimits' defaults)."""
    limits = limits or RunLimits()
    check_structure(spec, limits)
    return _Expander(spec, limits).cells()


def expand(spec: SweepSpec, limits: RunLimits | None = None) -> list[Cell]:
    """Every cell of the sweep as a validated RunConfig; SpecError (with field paths) otherwise."""
    return list(iter_cells(spec, limits))
