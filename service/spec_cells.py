"""Expanded cells, their canonical JSON and key, and the memo that makes a 100,000-cell
expansion cost a few microseconds a cell without dropping a check.

A cell's run config is its sweep's base with the cell's axis values; each check of a run
config reads a few of its fields. So every distinct axis value is validated once (as part of
the first cell that holds it, in full), every distinct kernel with its params once, and every
check of the whole config (RunConfig's model validators, the service's caps) once per distinct
combination of the fields it read; a cell whose every part was checked before is
accepted without validating it again, one whose any part is new is validated in full, as if
there were no memo. The memo switches itself off for good when a fully validated cell differs
from what it would have built for that cell.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from workers.config import RunConfig

Check = Callable[[Any], object]
"""A check of a whole run config: raises (or, for the service's caps, returns something true)
when the config is invalid; reads the config's fields as attributes."""


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, the form cell keys are computed from.

    Raises ValueError for NaN or infinite floats (not JSON; the database would refuse them).
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def cell_key_of(config_json: dict[str, Any]) -> str:
    """sha256 of a normalized run config (model_dump(mode='json')): equal cells, equal keys."""
    return hashlib.sha256(canonical_json(config_json).encode()).hexdigest()


@dataclass(slots=True, eq=False, repr=False)
class Cell:
    """One expanded cell: its normalized config as JSON, its key, its axis values, and its
    validated RunConfig (built from the JSON when first asked for, for a memoized cell: None
    until then)."""

    _config: RunConfig | None
    config_json: dict[str, Any]
    cell_key: str
    axes: dict[str, Any]
    built_over: dict[str, Any] | None = None
    """The memo's template this cell's JSON copies every field but `varies` from (the same
    objects), or None: a store diffing the cell against that template (its sweep's first
    cell) need compare only `varies`."""
    varies: tuple[str, ...] = ()

    @property
    def config(self) -> RunConfig:
        if self._config is None:
            self._config = RunConfig.model_validate(self.config_json)
        return self._config


class _Reads:
    """A run config that records which of its fields a check reads (a property's fields
    through the property); `opaque` when the check used anything else (a method), which no
    memo can key on."""

    __slots__ = ("_config", "names", "opaque")

    def __init__(self, config: RunConfig) -> None:
        self._config = config
        self.names: set[str] = set()
        self.opaque = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(type(self._config), name, None)
        if isinstance(attr, property) and attr.fget is not None:
            return attr.fget(self)
        if name in RunConfig.model_fields:
            self.names.add(name)
        else:
            self.opaque = True
        return getattr(self._config, name)


def model_checks() -> list[Check]:
    """RunConfig's model validators that check a built config (mode 'after')."""
    validators = RunConfig.__pydantic_decorators__.model_validators.values()
    return [v.func for v in validators if v.info.mode == "after"]


class CellMemo:
    """Builds the cells whose every part was checked before (see the module docstring).

    `axes`: (name, values) of every axis, in the expander's order: an axis that is a run
    config field sets that field; `kernel`, `params`, `params.<name>` and a run-level `mask`
    decide the cell's params together (with a `mask` axis, its causal too). `checks`: the
    checks of a whole config that every cell must pass.

    What a check read is keyed by the cell's axis indices that decide those fields (fields
    no axis sets are the same in every cell): a cell passes a check when an earlier cell
    with the same indices there passed it."""

    def __init__(self, axes: list[tuple[str, list[Any]]], checks: list[Check]) -> None:
        self.names = [name for name, _ in axes]
        self.raw = [values for _, values in axes]
        # a run-level mask sets params and causal (service.spec_mask): with a mask axis,
        # causal is decided with the params, by the same axes
        self.with_causal = "mask" in self.names
        deciding = {"kernel", "params", "mask"} | ({"causal"} if self.with_causal else set())
        self.sets = [
            n if "." not in n and n not in deciding - {"kernel"} else None for n in self.names
        ]  # the field each axis sets, None for params' parts
        self.params_at = tuple(a for a, n in enumerate(self.names) if n in deciding or "." in n)
        self.checks = checks
        self.values: list[dict[int, Any]] = [{} for _ in axes]
        self.params: dict[tuple[int, ...], Any] = {}
        self.causal: dict[tuple[int, ...], bool] = {}  # with_causal: by the params' axes
        self.passed: list[dict[tuple[int, ...], set[Any]]] = [{} for _ in checks]
        """Per check: the axes it read -> their indices (as _picker gives them) in cells that
        passed it."""
        self.pickers: dict[tuple[int, ...], Callable[[tuple[int, ...]], Any]] = {}
        self.varying: list[list[tuple[Callable[[tuple[int, ...]], Any], set[Any]]]] = [
            [] for _ in checks
        ]  # before the first cell is learnt, no check has passed
        """Per check some axis decides: (picker, passed indices) for each set of axes read."""
        self.template: dict[str, Any] | None = None
        self.pieces: list[dict[Any, str]] = [{} for _ in axes]
        self.params_pieces: dict[tuple[int, ...], str] = {}
        self.segments: list[str] = []
        self.states: dict[str, Any] = {}  # the first varying field's JSON -> sha256 so far
        self.slots: list[int] = []  # per varying field in key order: its axis, -1 for params
        self.fields: tuple[str, ...] = ()  # the fields axes vary
        self.on = True

    def _json(self, idx: tuple[int, ...]) -> dict[str, Any] | None:
        """The cell's config JSON from known parts, or None when a part is new."""
        assert self.template is not None
        config = dict(self.template)
        for a, field in enumerate(self.sets):
            if field is not None:
                known = self.values[a]
                i = idx[a]
                if i not in known:
                    return None
                config[field] = known[i]
        if self.params_at:
            combo = tuple([idx[a] for a in self.params_at])
            params = self.params.get(combo)
            if params is None:
                return None
            config["params"] = params
            if self.with_causal:
                config["causal"] = self.causal[combo]
        return config

    def _passes(self, idx: tuple[int, ...]) -> bool:
        """Whether every check passed before on a cell with the same indices where it read."""
        for alternatives in self.varying:
            for pick, keys in alternatives:
                if pick(idx) in keys:
                    break
            else:
                return False
        return True

    def _picker(self, where: tuple[int, ...]) -> Callable[[tuple[int, ...]], Any]:
        """A cell's indices on the axes `where` (one index alone, not in a tuple)."""
        pick = self.pickers.get(where)
        if pick is None:
            pick = self.pickers[where] = operator.itemgetter(*where) if where else _no_axes
        return pick

    def _layout(self, template: dict[str, Any]) -> None:
        """The key's constant JSON between the fields that axes vary, encoded once."""
        varying = {f: a for a, f in enumerate(self.sets) if f is not None}
        if self.params_at:
            varying["params"] = -1
        if self.with_causal:
            varying["causal"] = -2
        text, first = "", True
        for field in sorted(template):
            comma = "" if first else ","
            first = False
            if field in varying:
                self.segments.append(f"{text}{comma}{json.dumps(field)}:")
                self.slots.append(varying[field])
                text = ""
            else:
                text += f"{comma}{json.dumps(field)}:{canonical_json(template[field])}"
        self.segments.append(text)
        self.fields = tuple(varying)

    def _piece(self, slot: int, idx: tuple[int, ...], config: dict[str, Any]) -> str:
        """The canonical JSON of the value that fills the key's `slot`-th varying field."""
        a = self.slots[slot]
        if a == -2:
            return "true" if config["causal"] else "false"
        if a < 0:
            combo = tuple([idx[p] for p in self.params_at])
            piece = self.params_pieces.get(combo)
            if piece is None:
                piece = self.params_pieces[combo] = canonical_json(config["params"])
            return piece
        piece = self.pieces[a].get(idx[a])
        if piece is None:
            field = self.sets[a]
            assert field is not None  # a slot's axis sets its field
            piece = self.pieces[a][idx[a]] = canonical_json(config[field])
        return piece

    def _key(self, idx: tuple[int, ...], config: dict[str, Any]) -> str:
        """cell_key_of(config), from the constant parts and each axis value's JSON: the
        hash of everything up to the second varying field is computed once per value of
        the first (a copy of it hashes the rest)."""
        segments = self.segments
        if not self.slots:
            return hashlib.sha256(f"{{{segments[0]}}}".encode()).hexdigest()
        first = self._piece(0, idx, config)
        state = self.states.get(first)
        if state is None:
            opening = f"{{{segments[0]}{first}{segments[1]}".encode()
            state = self.states[first] = hashlib.sha256(opening)
        parts = []
        for slot in range(1, len(self.slots)):
            parts.append(self._piece(slot, idx, config))
            parts.append(segments[slot + 1])
        parts.append("}")
        digest = state.copy()
        digest.update("".join(parts).encode())
        return digest.hexdigest()

    def cell(self, idx: tuple[int, ...]) -> Cell | None:
        """The cell at `idx` when the memo holds every part of it, else None."""
        if not self.on or self.template is None or not self._passes(idx):
            return None
        config = self._json(idx)
        if config is None:
            return None
        axes = {name: self.raw[a][idx[a]] for a, name in enumerate(self.names)}
        return Cell(None, config, self._key(idx, config), axes, self.template, self.fields)

    def _axes_read(self, names: set[str]) -> tuple[int, ...]:
        """The axes that decide the fields a check read."""
        where = {a for a, f in enumerate(self.sets) if f is not None and f in names}
        if "params" in names or (self.with_causal and "causal" in names):
            where.update(self.params_at)
        return tuple(sorted(where))

    def learn(self, idx: tuple[int, ...], cell: Cell) -> None:
        """Remember the parts of a cell validated in full, and the axes each check read."""
        if not self.on:
            return
        given = cell.config_json
        if self.template is None:
            self.template = given
            self._layout(given)
        for a, field in enumerate(self.sets):
            if field is not None:
                self.values[a].setdefault(idx[a], given[field])
        if self.params_at:
            combo = tuple([idx[a] for a in self.params_at])
            self.params.setdefault(combo, given["params"])
            if self.with_causal:
                self.causal.setdefault(combo, given["causal"])
        shared = self._json(idx)
        if shared is None or shared != given or self._key(idx, shared) != cell.cell_key:
            self.on = False  # a cell is not its base with its axis values: memo nothing
            return
        for check, passed in zip(self.checks, self.passed, strict=True):
            if any(self._picker(where)(idx) in keys for where, keys in passed.items()):
                continue  # known to pass with this cell's values there
            reads = _Reads(cell.config)
            check(reads)
            if reads.opaque:
                self.on = False
                return
            where = self._axes_read(reads.names)
            passed.setdefault(where, set()).add(self._picker(where)(idx))
        # a check that read no field an axis sets passed for every cell
        self.varying = [
            [(self.pickers[where], keys) for where, keys in p.items()]
            for p in self.passed
            if () not in p
        ]


def _no_axes(idx: tuple[int, ...]) -> tuple[()]:
    """The indices of a check that read no field an axis sets: the same for every cell."""
    return ()


def all_plain(names: Iterable[str]) -> bool:
    """Whether the memo can build cells with these axes: none makes a model cell."""
    return not any(n.split(".")[0] in ("workload", "model", "training") for n in names)
