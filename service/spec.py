"""The sweep spec: a base run config plus grid and zip axes, expanded into validated run configs.

The API, the CLI and the scheduler share it. Errors carry a field path (`loc`) and name the bad
cell's axis values, so the API can answer 422 with the exact place to fix.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from attention.errors import ParamError
from service.core.config import RunLimits
from service.spec_cells import Cell, CellMemo, all_plain, canonical_json, cell_key_of, model_checks
from workers import resolved
from workers.config import RunConfig, SearchConfig

MAX_CELLS = RunLimits.cells
"""A grid larger than this (by default; RINGLAB_MAX_CELLS) is rejected before expanding."""
MAX_SEQ_LEN = 2**63 - 1
"""seq_len is a 64-bit column."""
MAX_ERRORS = 20
"""Expansion stops after this many distinct errors (the rest are usually the same mistake)."""
RUN_FIELDS = frozenset(RunConfig.model_fields) - {"search"}

Loc = tuple[str | int, ...]
Position = dict[str, tuple[str, int]]


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


NESTED = ("params", "model", "training")
"""Config fields that are objects: an axis or baseline change names one of their fields as
`<field>.<name>` (params.block_size, model.d_model, training.precision)."""


def nested_axis(name: str) -> tuple[str, str] | None:
    """'model.d_model' -> ('model', 'd_model'); None for a plain field name."""
    head, dot, rest = name.partition(".")
    if dot and head in NESTED and rest.isidentifier():
        return head, rest
    return None


def _axis_name(name: str) -> str:
    """A run config field or <params|model|training>.<name>, else ValueError naming what is
    allowed."""
    if nested_axis(name) is not None:
        return name
    if name in RUN_FIELDS and name != "params":
        return name
    raise ValueError(
        f"{name!r} is not a run config field, params.<name>, model.<name> or training.<name>"
    )


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
        raise ValueError(_shown_key(f"{'.'.join(map(str, path))}: {reason}"))
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
        return value if value == "label" else _axis_name(value)

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: list[str]) -> list[str]:
        return [v if v == "label" else _axis_name(v) for v in value]


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
                _axis_name(key)
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
        default_factory=dict, description="A partial run config shared by every cell."
    )
    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Axis -> values; the cells are their cartesian product. Axes are run config "
        "fields, `params.<name>`, `model.<name>`, `training.<name>`, or `params` / `model` / "
        "`training` with whole objects as values (merged over the base's; a `params` axis zipped "
        "with `kernel` gives each kernel its own params).",
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


MAX_JSON_INT = 2**53 - 1
"""The largest integer every JSON reader holds exactly (a double's 53 bits); any larger is no
size or count a run can mean (window 2^62, batch_size 2^63), so it is refused, not stored."""
MAX_DEPTH = 32
"""Deepest nesting of objects and lists a spec may have (real specs nest 4 levels)."""


def _string_problem(text: str) -> tuple[str, str] | None:
    """(message, type) when `text` cannot be stored or sent back as UTF-8 text, else None."""
    if "\x00" in text:
        return "must not contain NUL (\\x00) characters", "string_nul"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"holds a lone surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, "
            "which is no Unicode text",
            "string_unicode",
        )
    return None


def _scalar_problem(value: Any) -> tuple[str, str] | None:
    """(message, type) for a string, number or key that no database column or JSON reader
    holds as given: NUL, a lone surrogate, NaN or an infinity, an integer beyond 2^53 - 1."""
    if isinstance(value, str):
        return _string_problem(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}", "finite_number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_JSON_INT:
        return f"must be within +-{MAX_JSON_INT:,} (2^53 - 1), got {value:.3g}", "int_too_big"
    return None


def _shown_key(key: Any) -> str:
    """A key as an error's loc shows it: NUL and lone surrogates escaped."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def unstorable_values(value: Any, loc: Loc = ()) -> list[dict[str, Any]]:
    """Errors (pydantic's shape) for every value or key of a submitted document that cannot
    be stored and read back as given (_scalar_problem), and for nesting deeper than MAX_DEPTH.

    Checked before anything is expanded or stored, so every database the service runs on
    (Postgres refuses NUL and lone surrogates in text) answers one 422 with the path, never a
    500. Iterative: a hostile depth cannot exhaust the interpreter's stack."""
    found: list[dict[str, Any]] = []
    stack: list[tuple[Any, Loc]] = [(value, loc)]
    while stack and len(found) <= MAX_ERRORS:
        item, where = stack.pop()
        if isinstance(item, dict | list | tuple) and len(where) - len(loc) >= MAX_DEPTH:
            found.append(_err(where, f"nested deeper than {MAX_DEPTH} levels", "too_deep"))
            continue
        if isinstance(item, dict):
            for key, sub in reversed(item.items()):
                shown = (*where, _shown_key(key))
                if (problem := _scalar_problem(key)) is not None:
                    found.append(_err(shown, f"key {problem[0]}", problem[1]))
                stack.append((sub, shown))
        elif isinstance(item, list | tuple):
            stack.extend((sub, (*where, i)) for i, sub in reversed(list(enumerate(item))))
        elif (problem := _scalar_problem(item)) is not None:
            found.append(_err(where, *problem))
    return found


class SpecError(ValueError):
    """A spec that cannot be expanded; `errors` are pydantic-style dicts (loc without 'body')."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))


def _err(loc: Loc, msg: str, kind: str = "value_error") -> dict[str, Any]:
    return {"loc": list(loc), "msg": msg, "type": kind}


def cell_key(config: RunConfig) -> str:
    """sha256 of the normalized run config: identical cells get identical keys."""
    return cell_key_of(config.model_dump(mode="json"))


def cell_count(spec: SweepSpec) -> int:
    """How many cells the spec expands into (before validation)."""
    grid = math.prod(len(v) for v in spec.grid.values())
    zipped = len(next(iter(spec.zip.values()))) if spec.zip else 1
    return grid * zipped


def field_error(detail: Any) -> tuple[tuple[str, ...], str] | None:
    """(field path, reason) of a validator's ParamError (attention's checks, RunConfig's
    validators), read from the exception pydantic keeps; None for other errors."""
    error = (detail.get("ctx") or {}).get("error")
    if isinstance(error, ParamError):
        return error.path, error.reason
    return None


def split_message(msg: str) -> tuple[tuple[str, ...], str] | None:
    """'params.block_size: reason' -> (('params', 'block_size'), 'reason'); None if no field.

    RunConfig's model validator and attention.validate start their messages with the field.
    """
    head, sep, reason = msg.partition(": ")
    if not sep:
        return None
    path = tuple(head.split("."))
    if path[0] not in RUN_FIELDS or not all(p.isidentifier() for p in path):
        return None
    return path, reason


def _check_axis(where: str, axis: str) -> dict[str, Any] | None:
    head, dot, name = axis.partition(".")
    if dot and head in NESTED:
        if not name.isidentifier():
            return _err((where, axis), f"{name!r} is not a field name of {head}")
        if head != "params":
            from workers.config import ModelConfig, TrainingConfig

            fields = (ModelConfig if head == "model" else TrainingConfig).model_fields
            if name not in fields:
                valid = ", ".join(sorted(fields))
                return _err((where, axis), f"unknown field of {head}: {name!r}; valid: {valid}")
        return None
    if axis == "search":
        return _err((where, axis), "search is not an axis; use the sweep's search block")
    if axis not in RUN_FIELDS:
        valid = ", ".join(sorted(RUN_FIELDS - set(NESTED)))
        return _err(
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
            errors.append(_err(("base", key), "put the search block at the top level of the sweep"))
        elif key not in RUN_FIELDS:
            errors.append(
                _err(("base", key), f"unknown run config field {key!r}", "extra_forbidden")
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
                errors.append(_err((where, axis), "an axis needs at least one value"))
    for axis in spec.grid.keys() & spec.zip.keys():
        errors.append(_err(("zip", axis), f"axis {axis!r} is in both grid and zip"))
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
                    _err(
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
                _err(
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
        return [_err(("search",), f"a search block needs kind max_seq_len, not {spec.kind}")]
    errors = [
        _err(
            (where, "seq_len"),
            "a max_seq_len sweep searches seq_len; set search.start and search.max",
        )
        for where, axes in (("base", spec.base), ("grid", spec.grid), ("zip", spec.zip))
        if "seq_len" in axes
    ]
    if spec.search is None:  # no silent default: a search up to 16M tokens is rarely meant
        errors.append(
            _err(
                ("search",),
                "a max_seq_len sweep needs a search block (start, max, granularity), e.g. "
                "search: {start: 1024, max: 65536, granularity: 1024}",
                "missing",
            )
        )
    return errors


def _check_structure(spec: SweepSpec, limits: RunLimits) -> None:
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
                _err(
                    ("grid",),
                    f"the sweep has {n:,} cells; at most {limits.cells:,} are allowed "
                    "(RINGLAB_MAX_CELLS)",
                )
            ]
        )


def _over(field: str, value: float, cap: float, setting: str) -> tuple[str, str] | None:
    """(field, message) when value exceeds the cap named by RINGLAB_<setting>."""
    if value <= cap:
        return None
    return field, f"must be <= {_num(cap)} (RINGLAB_{setting}), got {_num(value)}"


def _num(value: float) -> str:
    """A cap or value as a message shows it: integers in full, other floats short."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    return f"{value:,g}"


Problems = list[tuple[tuple[str, ...], str]]


def _cap(field: str, cap: float, setting: str) -> Callable[[RunConfig], Problems]:
    """The check of one field against its cap (RINGLAB_<setting>)."""

    def check(config: RunConfig) -> Problems:
        over = _over(field, getattr(config, field), cap, setting)
        return [] if over is None else [(tuple(field.split(".")), over[1])]

    return check


def limit_checks(limits: RunLimits) -> list[Callable[[RunConfig], Problems]]:
    """The service's caps (RunLimits), each a check of the few fields it reads: a sweep's
    expansion remembers each one's answer per distinct value of those (service.spec_cells)."""

    def iterations(config: RunConfig) -> Problems:
        if config.iterations == "auto":
            return []
        return _cap("iterations", limits.iterations, "MAX_ITERATIONS")(config)

    def elements(config: RunConfig) -> Problems:
        longest = config.search.max if config.search is not None else config.seq_len
        total = longest * config.num_heads * config.head_dim
        if total <= limits.elements:
            return []
        what = "search.max" if config.search is not None else "seq_len"
        path = ("search", "max") if config.search is not None else ("seq_len",)
        return [
            (
                path,
                f"{what} x num_heads x head_dim = {total:,} must be <= {limits.elements:,} "
                "(RINGLAB_MAX_ELEMENTS)",
            )
        ]

    return [
        _cap("timeout_s", limits.timeout_s, "MAX_TIMEOUT_S"),
        _cap("dist_timeout_s", limits.timeout_s, "MAX_TIMEOUT_S"),
        _cap("warmup", limits.warmup, "MAX_WARMUP"),
        _cap("batch_size", limits.batch_size, "MAX_BATCH_SIZE"),
        iterations,
        elements,
    ]


def limit_problems(config: RunConfig, limits: RunLimits) -> Problems:
    """(path, message) for every field of `config` above the service's caps (RunLimits)."""
    return [problem for check in limit_checks(limits) for problem in check(config)]


@lru_cache(maxsize=64)
def _params_adapter(params_type: type) -> TypeAdapter[Any]:
    return TypeAdapter(params_type)


def _kernels() -> dict[str, Any]:
    import attention

    return attention.KERNELS


ParamsCheck = tuple[dict[str, Any] | None, list[tuple[tuple[str | int, ...], str]]]


def _unknown_kernel(kernel: Any, kernels: Iterable[str]) -> str:
    """'unknown kernel 'ring_dilatd'; did you mean 'ring_dilated'? valid: ...'."""
    import difflib

    names = sorted(kernels)
    close = difflib.get_close_matches(str(kernel), names, n=1) if isinstance(kernel, str) else []
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown kernel {kernel!r}; {hint}valid: {', '.join(names)}"


def normalize_params(kernel: Any, params: Any) -> ParamsCheck:
    """Check a kernel's params strictly (types included) and fill in their defaults.

    Returns (normalized params, []) or (None, [(field path, reason), ...]) where the path starts
    with 'kernel' or 'params'.
    """
    from attention.registry import unavailable

    kernels = _kernels()
    if isinstance(kernel, str) and (why := unavailable(kernel)) is not None:
        return None, [(("kernel",), why)]
    if not isinstance(kernel, str) or kernel not in kernels:
        return None, [(("kernel",), _unknown_kernel(kernel, kernels))]
    if not isinstance(params, dict):
        return None, [(("params",), "must be an object of the kernel's parameters")]
    params_type = kernels[kernel].params
    names = [f.name for f in dataclasses.fields(params_type) if f.init]
    unknown = sorted(set(params) - set(names))
    if unknown:
        valid = ", ".join(sorted(names)) or "none"
        return None, [
            (("params", name), f"unknown parameter of kernel {kernel!r}; valid: {valid}")
            for name in unknown
        ]
    adapter = _params_adapter(params_type)
    try:
        # JSON mode, strict: "64" is not an int, but a JSON array is a valid tuple.
        parsed = adapter.validate_json(canonical_json(params), strict=True)
    except ValidationError as e:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for d in e.errors():
            msg = d["msg"].removeprefix("Value error, ")
            split = (field_error(d) or split_message(msg)) if not d["loc"] else None
            if split is not None:
                problems.append(split)
            else:
                problems.append((("params", *d["loc"]), msg))
        return None, problems
    dumped = adapter.dump_python(parsed, mode="json")
    return {k: dumped[k] for k in names}, []


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
        self.params_cache: dict[tuple[int, ...], ParamsCheck] = {}
        self.reported: set[tuple[Loc, str]] = set()
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
        where it would be written: ('base', field, ...).
        """
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
        """Record an error once per (place, reason), naming the first cell that hit it."""
        if (loc, msg) in self.reported:
            return
        self.reported.add((loc, msg))
        where = ", ".join(f"{k}={v!r}" for k, v in axes.items())
        self.errors.append(_err(loc, f"{msg} (cell {where})" if axes else msg, kind))

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
        """Validate kernel and params (cached per distinct pair); normalize raw['params']."""
        kernel, params = raw.get("kernel"), raw["params"]
        if kernel is None:
            return True  # RunConfig reports the missing field
        # kernel and params come from base plus these axes: their indices identify the pair.
        key = tuple(
            i
            for (name, _, _), i in zip(self.axes, idx, strict=True)
            if name in ("kernel", "params") or name.startswith("params.")
        )
        if key not in self.params_cache:
            self.params_cache[key] = normalize_params(kernel, params)
        normalized, problems = self.params_cache[key]
        for path, msg in problems:
            self.add(self.locate(self.position(idx), path), msg, axes)
        if normalized is None:
            return False
        raw["params"] = normalized
        return True

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
                typed = field_error(d)
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
            cell = memo.cell(idx) if memo is not None and not self.errors else None
            if cell is None:
                raw, axes = self.build(idx)
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
    _check_structure(spec, limits)
    return _Expander(spec, limits).cells()


def expand(spec: SweepSpec, limits: RunLimits | None = None) -> list[Cell]:
    """Every cell of the sweep as a validated RunConfig; SpecError (with field paths) otherwise."""
    return list(iter_cells(spec, limits))
