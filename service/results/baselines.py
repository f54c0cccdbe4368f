"""What a sweep's rows are compared against: baselines and ratios, readable labels, the pivot.

A run's baseline is another run of the same sweep: the one the spec's `analysis.baseline` names
(the run's own config with those fields replaced), else by default world size 1 of the same cell
for a W>1 cell (a ring kernel falls back to its single-process twin), else dense attention of
the same shape for a sparse or dilated cell. The ratios against it:

- speedup = tokens/s / baseline tokens/s (= baseline time / time when both process the same
  tokens; a max_seq_len run compares the throughput at each one's maximum length);
- memory ratio = peak memory per rank / baseline peak memory per rank;
- max-length gain = maximum length / baseline maximum length;
- scaling efficiency (only where the world sizes differ) = speedup (or the max-length gain for a
  search) / (world size / baseline world size): strong scaling keeps the global batch and length,
  weak scaling (`analysis.scaling: weak`) gives the baseline one rank's share of them.

Every ratio of two times carries its noise: from both runs' median intervals (service.results.rows),
ratio_lo = a_lo / b_hi and ratio_hi = a_hi / b_lo (workers.noise.ratio_interval): speedup_lo/hi,
efficiency_lo/hi (timed runs), checkpoint_time_ratio_lo/hi. A ratio whose interval holds 1.0 is
named in the row's `within_noise`. Peak memory and maximum length are one measurement each (no
repeats, no spread): their ratios have no interval.

A ratio above its physical limit is flagged (views.Flag), never shown plainly: against the same
work on fewer ranks (same_work), a speedup above the world-size ratio (W / baseline W) beyond
its interval
(speedup_above_world_size), and so a scaling efficiency above 100% beyond its interval
(efficiency_above_100; for a max_seq_len run, a max-length gain above the world-size ratio).
Without an interval (one iteration) a ratio above its limit is flagged all the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import attention
from service.results.rows import Flag, RunRow
from service.spec import NESTED, AnalysisSpec, PivotSpec, nested_axis
from service.units import natural_key
from workers import resolved
from workers.config import PRECISION_DTYPES
from workers.noise import Interval, ratio_interval, scaled

DENSE_KERNELS = frozenset(k for k, spec in attention.KERNELS.items() if spec.dense_baseline)

IGNORED_FOR_MATCHING = frozenset(
    {
        "name", "tags", "label", "timeout_s", "dist_timeout_s", "max_attempts", "warmup",
        "iterations", "time_cap_s", "placement", "isolation", "fresh_processes", "env",
        "correctness_check", "search", "seed",
    }
)  # fmt: skip
"""Fields that do not change what a run computes: a baseline matches whatever their values."""

LABEL_FIELDS = (
    "world_size", "parallel", "dtype", "mode", "causal", "batch_size", "num_heads",
    "num_kv_heads", "head_dim", "memory_budget_bytes", "profile",
)  # fmt: skip
"""Config fields a label shows when they vary within the sweep (after the kernel and params)."""


def _match_key(config: dict[str, Any]) -> str:
    kept = {k: v for k, v in config.items() if k not in IGNORED_FOR_MATCHING}
    # A param set to None is the kernel's own default, as if unset: a cell stored before the
    # kernel gained that param (dense's document_lengths) still matches one stored after.
    # So is a value resolved from the default when the run was expanded (workers.resolved).
    kept["params"] = _given(kept)
    if kept.get("world_size", 1) == 1:
        kept["parallel"] = "sequence"  # one rank: data and sequence parallel are the same run
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)


def _given(config: dict[str, Any]) -> dict[str, Any]:
    """The config's params without None and without what expansion resolved from a default."""
    return resolved.as_given(
        str(config.get("kernel")),
        config.get("params") or {},
        causal=bool(config.get("causal")),
        device=str(config.get("device", "auto")),
    )


def _with(config: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """The config with fields (or `params.<name>`, `model.<name>`, `training.<name>`) replaced."""
    out = dict(config)
    out["params"] = _given(config)  # the params as given: the changed kernel's resolve anew
    for key, value in changes.items():
        nested = nested_axis(key)
        if nested is not None:
            head, name = nested
            out[head] = {**(out.get(head) or {}), name: value}
        elif key in NESTED:
            out[key] = dict(value) if isinstance(value, dict) else value
        else:
            out[key] = value
    if out.get("workload") == "model":  # what a model cell derives from its model and precision
        model, training = out.get("model") or {}, out.get("training") or {}
        if model.get("n_heads") and model.get("d_model"):
            out["num_heads"] = model["n_heads"]
            out["num_kv_heads"] = model.get("num_kv_heads")  # as RunConfig fills it in
            out["head_dim"] = model["d_model"] // model["n_heads"]
        if training.get("precision") in PRECISION_DTYPES:
            out["dtype"] = PRECISION_DTYPES[training["precision"]]
    return out


def _world_change(config: dict[str, Any], world: int, scaling: str) -> dict[str, Any]:
    """The config at another world size: the same global work (strong), or one rank's (weak)."""
    out = {**config, "world_size": world}
    if scaling == "weak":
        ratio = config["world_size"] // world
        if config.get("parallel") == "data":
            out["batch_size"] = config.get("batch_size", 1) // ratio
        else:
            out["seq_len"] = config["seq_len"] // ratio
    return out


def _targets(row: RunRow, spec: AnalysisSpec) -> list[tuple[dict[str, Any], str]]:
    """The configs that would be this run's baseline, best first, each with its name.

    A world-size baseline is looked for with the sweep's scaling first; under strong scaling a
    data-parallel cell whose sweep only has one rank's share at W=1 (weak scaling) falls back
    to it, named so.
    """
    cfg = row.config
    changes = spec.baseline
    if changes is None:
        if row.world_size > 1:
            changes = {"world_size": 1}
        elif row.kernel not in DENSE_KERNELS:
            changes = {"kernel": attention.exact_dense(), "params": {}}
        else:
            return []
    world = changes.get("world_size")
    rest = {k: v for k, v in changes.items() if k != "world_size"}
    name = ", ".join(
        f"{k.split('.', 1)[-1]}={'none' if v is None else _text(v)}"
        for k, v in changes.items()
        if k != "params"
    )  # params.block_size=64, precision=fp32 (the group a field belongs to is implied)
    if "kernel" in changes and "params" in changes and len(changes) == 2:
        name = str(changes["kernel"])
    if world is None:
        found = [(_with(cfg, rest), name)]
    else:
        name = name.replace("world_size=", "W=")
        # Only data parallelism falls back to weak scaling: its ranks then do equal work, where a
        # ring's share of a longer sequence costs more per rank (attention is quadratic).
        fallback = spec.scaling == "strong" and cfg.get("parallel") == "data"
        scalings = [spec.scaling] + (["weak"] if fallback else [])
        found = [
            (
                _world_change(_with(cfg, rest), world, s),
                name + (" (weak)" if s != spec.scaling else ""),
            )
            for s in scalings
        ]
    if any(_match_key(t) == _match_key(cfg) for t, _ in found):
        return []  # the run is its own baseline
    out = []
    for target, tname in found:
        out.append((target, tname))
        kernel = str(target.get("kernel"))
        twin = attention.twin_of(kernel) if kernel in attention.KERNELS else None
        if twin is not None and target.get("world_size") == 1:
            params = attention.twin_params(target["params"])
            out.append(({**target, "kernel": twin, "params": params}, f"{twin} {tname}"))
    return out


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass(frozen=True)
class Refs:
    """The other runs of its sweep a run is compared against, found from configs alone."""

    baseline: tuple[int, str] | None = None
    """(run id, name) of its baseline."""
    without_checkpointing: int | None = None
    """A model run with checkpointing: the same cell without it."""


class ReferenceFinder:
    """Finds every run's Refs in one pass over a sweep's rows in id order (results not needed),
    keeping per run only short digests of the configs it looks for: a 100,000-run sweep is
    resolved without holding its rows."""

    def __init__(self, spec: AnalysisSpec | None) -> None:
        self.spec = spec or AnalysisSpec()
        self.first: dict[bytes, int] = {}  # match key -> the lowest run id with it
        self.wanted: list[tuple[int, list[tuple[bytes, str]], bytes | None]] = []

    def add(self, row: RunRow) -> None:
        """One row (rows come in id order)."""
        self.first.setdefault(_digest(row.config), row.run_id)
        targets = [(_digest(t), name) for t, name in _targets(row, self.spec)]
        plain = None
        checkpointing = (row.config.get("training") or {}).get("checkpointing")
        if row.workload == "model" and checkpointing not in (None, "none"):
            changes = {"training.checkpointing": "none", "training.checkpoint_every": None}
            plain = _digest(_with(row.config, changes))
        if targets or plain is not None:
            self.wanted.append((row.run_id, targets, plain))

    def refs(self) -> dict[int, Refs]:
        """Run id -> Refs for every run that has a reference."""
        out = {}
        for run_id, targets, plain in self.wanted:
            found = [(self.first[k], name) for k, name in targets if k in self.first]
            without = self.first.get(plain) if plain is not None else None
            if found or without is not None:
                out[run_id] = Refs(found[0] if found else None, without)
        return out


def _digest(config: dict[str, Any]) -> bytes:
    return hashlib.blake2b(_match_key(config).encode(), digest_size=16).digest()


def references(rows: Sequence[RunRow], spec: AnalysisSpec | None) -> dict[int, Refs]:
    """Run id -> Refs for rows holding a whole sweep in id order."""
    finder = ReferenceFinder(spec)
    for r in rows:
        finder.add(r)
    return finder.refs()


def fill(rows: Sequence[RunRow], by_id: dict[int, RunRow], refs: dict[int, Refs]) -> None:
    """Fill the rows' baselines and ratios (in place) from their Refs; `by_id` holds at least
    the rows they refer to. Rows without a baseline keep None."""
    for r in rows:
        ref = refs.get(r.run_id)
        if ref is None:
            continue
        if ref.baseline is not None:
            base, name = by_id[ref.baseline[0]], ref.baseline[1]
            r.baseline_run_id, r.baseline = base.run_id, name
            r.speedup = _ratio(r.tokens_per_s, base.tokens_per_s)
            r.memory_ratio = _ratio(r.peak_memory_bytes, base.peak_memory_bytes)
            r.max_len_gain = _ratio(r.max_seq_len, base.max_seq_len)
            gain = r.max_len_gain if r.searched else r.speedup
            if base.world_size != r.world_size and gain is not None:
                r.efficiency = gain / (r.world_size / base.world_size)
            _speedup_noise(r, base)
            r.flags += limit_flags(r, base)
        if ref.without_checkpointing is not None:  # the step-time cost of checkpointing
            without = by_id[ref.without_checkpointing]
            if not r.searched and r.median_s and without.median_s:
                r.checkpoint_time_ratio = r.median_s / without.median_s
                spread = ratio_interval(r.time_interval, without.time_interval)
                if spread is not None:
                    r.checkpoint_time_ratio_lo, r.checkpoint_time_ratio_hi = spread.lo, spread.hi
                    _within(r, "checkpoint_time_ratio", spread)


def _within(row: RunRow, name: str, spread: Interval) -> None:
    """Name ratio `name` in row.within_noise when its interval holds 1.0."""
    if spread.holds(1.0) and name not in row.within_noise:
        row.within_noise.append(name)


def _speedup_noise(row: RunRow, base: RunRow) -> None:
    """The speedup's interval from both runs' tokens/s intervals, and the efficiency's (a
    timed run at another world size: the speedup's over the world-size ratio)."""
    spread = ratio_interval(row.tokens_per_s_interval, base.tokens_per_s_interval)
    if spread is None or row.speedup is None:
        return
    row.speedup_lo, row.speedup_hi = spread.lo, spread.hi
    _within(row, "speedup", spread)
    if not row.searched and row.efficiency is not None:
        eff = scaled(spread, base.world_size / row.world_size)
        assert eff is not None  # spread is not None
        row.efficiency_lo, row.efficiency_hi = eff.lo, eff.hi


SCALING_FIELDS = frozenset({"world_size", "parallel", "batch_size", "seq_len", "kernel", "params"})
"""What a world-size baseline may change: the ranks, how they split the work, and (weak
scaling) its size; the kernel only for its single-process twin."""


def same_work(row: RunRow, base: RunRow) -> bool:
    """Whether `base` is `row` at another world size (the same kernel, or its single-process
    twin with the twin's params), so W / baseline W bounds the speedup; a baseline that also
    changes the kernel, a param or the dtype (a custom `analysis.baseline`) bounds nothing."""
    kept = [
        {k: v for k, v in r.config.items() if k not in SCALING_FIELDS | IGNORED_FOR_MATCHING}
        for r in (row, base)
    ]
    if kept[0] != kept[1]:
        return False
    params = {k: v for k, v in row.params.items() if v is not None}
    base_params = {k: v for k, v in base.params.items() if v is not None}
    if row.kernel == base.kernel:
        return params == base_params
    if row.kernel not in attention.KERNELS or attention.twin_of(row.kernel) != base.kernel:
        return False
    twin = {k: v for k, v in attention.twin_params(row.params).items() if v is not None}
    return twin == base_params


def limit_flags(row: RunRow, base: RunRow) -> list[Flag]:
    """Flags of ratios above the physical limit of a run at W ranks against the same work at
    fewer (same_work): W / baseline W for the speedup, 100% for the efficiency; beyond the
    interval where there is one (see the module docstring)."""
    limit = row.world_size / base.world_size
    if limit <= 1 or not same_work(row, base):
        return []
    flags = []
    speedup, low = row.speedup, row.speedup_lo
    beyond = speedup is not None and (low if low is not None else speedup) > limit
    if not row.searched and speedup is not None and beyond:
        noise = (
            f"its interval {low:.2f}-{row.speedup_hi:.2f}x lies above"
            if low is not None
            else "with no interval to tell the noise (a run of 1 iteration), above"
        )
        why = f"{row.world_size} ranks against {base.world_size} can at most reach {limit:g}x"
        flags.append(
            Flag(
                "speedup_above_world_size",
                "speedup",
                f"speedup {speedup:.2f}x above the physical limit: {noise} {limit:g}x ({why})",
            )
        )
        flags.append(
            Flag(
                "efficiency_above_100",
                "efficiency",
                f"scaling efficiency {speedup / limit:.0%} above 100% beyond the noise: "
                "the speedup it follows from is above the world-size ratio",
            )
        )
    gain = row.max_len_gain
    if row.searched and gain is not None and gain > limit:
        flags.append(
            Flag(
                "efficiency_above_100",
                "efficiency",
                f"scaling efficiency {gain / limit:.0%} above 100%: a max-length gain of "
                f"{gain:.2f}x at {limit:g}x the ranks (each rank holds a 1/{limit:g} share, "
                "so its memory per token would have to fall)",
            )
        )
    return flags


def apply(rows: Sequence[RunRow], spec: AnalysisSpec | None) -> None:
    """Fill every row's baseline and ratios (in place) for rows holding a whole sweep."""
    fill(rows, {r.run_id: r for r in rows}, references(rows, spec))


# ---------------------------------------------------------------- labels


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _field_text(name: str, value: Any) -> str | None:
    """One label part; None for a value that is unset (the kernel's own choice)."""
    if value is None:
        return None
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
    return f"{name.removeprefix('training.')}={_text(value)}"


TRAINING_FIELDS = ("optimizer", "precision", "checkpointing", "checkpoint_every",
                   "loss_chunk_tokens")  # fmt: skip
"""A model cell's training settings a label shows when they vary (as training.<name>)."""


LABEL_AXES = ("model", *LABEL_FIELDS, *(f"training.{t}" for t in TRAINING_FIELDS))
"""Everything but params a label may show, in its order."""


class Varying:
    """What differs between rows, from one pass over them: the distinct texts of every param
    and label field (a param some rows lack counts as None there)."""

    def __init__(self) -> None:
        self.rows = 0
        self.params: dict[str, set[str]] = {}
        self.ran: dict[str, set[str]] = {}  # the values that ran, resolved defaults included
        self.with_param: dict[str, int] = {}
        self.fields: dict[str, set[str]] = {f: set() for f in LABEL_AXES}

    def add(self, row: RunRow) -> None:
        self.rows += 1
        given = _given(row.config)  # what was asked for: a resolved default counts as unset
        for k, v in row.params.items():
            self.params.setdefault(k, set()).add(_text(given.get(k)))
            self.ran.setdefault(k, set()).add(_text(v))
            self.with_param[k] = self.with_param.get(k, 0) + 1
        for f, seen in self.fields.items():
            seen.add(_text(_axis_value(row, f)))

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


def varying(rows: Sequence[RunRow]) -> tuple[list[str], list[str]]:
    """(params, config fields) whose value differs between the rows (see Varying)."""
    found = Varying()
    for r in rows:
        found.add(r)
    return found.result()


def label(row: RunRow, vary_params: Sequence[str], vary_fields: Sequence[str]) -> str:
    """The kernel and only what varies within the sweep (never an unset parameter)."""
    parts = [row.kernel]
    parts += [t for p in vary_params if (t := _field_text(p, row.params.get(p))) is not None]
    for f in vary_fields:
        if f == "parallel" and row.world_size == 1:
            continue  # one rank: data and sequence parallel are the same run
        if (text := _field_text(f, _axis_value(row, f))) is not None:
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


# ---------------------------------------------------------------- pivot

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


def _axis_value(row: RunRow, name: str) -> Any:
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


def _sort_key(value: Any) -> tuple[int, Any]:
    """Numbers first, in numeric order; then text with its numbers read as numbers ("W=4"
    before "W=16"), a list of numbers element by element ([1,2] before [1,2,4])."""
    if isinstance(value, int | float):
        return (0, value)
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return (1, ((0, "["), *((1, float(v)) for v in value)))  # sorts as its text would
    return (1, natural_key(_text(value)))


def default_pivot(rows: Sequence[RunRow]) -> PivotSpec | None:
    """Time per length (rows) x world size and parallel mode (columns), where those vary; the
    kernel joins the columns when kernels run at different (world size, parallel) pairs (dense
    at W=1 and W=2 data-parallel, ring at W=2: see pivot), so a row is never half empty.
    Whatever else varies (mode, params, ...) makes the pivot's sections."""
    bench = [r for r in rows if not r.searched]
    if len({r.seq_len for r in bench}) < 2:
        return None
    columns = [f for f in ("world_size", "parallel") if len({r.config.get(f) for r in bench}) > 1]
    return PivotSpec(rows="seq_len", columns=columns or ["label"], value="median_s")


def pivot_spec(spec: AnalysisSpec | None, rows: Sequence[RunRow]) -> PivotSpec | None:
    """The sweep's own pivot, else the default one (None when nothing is worth pivoting)."""
    if spec is not None and spec.pivot is not None:
        return spec.pivot
    return default_pivot(rows)


def _column_text(row: RunRow, columns: Sequence[str]) -> str:
    """A run's column in a pivot: "dense · W=2 · data-parallel"; one rank has no parallel mode
    ("W=1", also where the world size is not a column)."""
    parts = []
    for c in columns:
        value = _axis_value(row, c)
        if c == "label" or c == "kernel":
            parts.append(str(value))
        elif c == "parallel" and row.world_size == 1:
            if "world_size" not in columns:
                parts.append("W=1")
        elif (t := _field_text(c.removeprefix("params."), value)) is not None:
            parts.append(t)
    return " · ".join(parts) or "-"


def _shown(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else _text(value)


def _axis_title(name: str) -> str:
    return {"world_size": "world size", "seq_len": "seq len"}.get(
        name, name.removeprefix("params.").replace("_", " ")
    )


def _section_fields(rows: Sequence[RunRow], used: set[str]) -> list[str]:
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


def _section_value(row: RunRow, name: str) -> str:
    value = _axis_value(row, name)
    if value is None or (name == "parallel" and row.world_size == 1):
        return ""
    return _text(value)


def _section_title(row: RunRow, fields: Sequence[str]) -> str:
    parts = []
    for f in fields:
        if f == "parallel" and row.world_size == 1:
            continue
        value = _axis_value(row, f)
        if f == "world_size":
            parts.append(f"W={value}")
        elif value is not None:
            parts.append(f"{_axis_title(f)} {_text(value)}")
    return " · ".join(parts)


def _splits_columns(rows: Sequence[RunRow], name: str, columns: Sequence[str]) -> bool:
    """Whether the runs of each value of `name` fill different columns (dense at W=1 and W=2
    data-parallel, ring at W=2 sequence-parallel): then `name` belongs in the columns, or
    every section would be half empty."""
    filled: dict[str, set[str]] = {}
    for r in rows:
        filled.setdefault(_text(_axis_value(r, name)), set()).add(_column_text(r, columns))
    return len({frozenset(v) for v in filled.values()}) > 1


def _together(rows: Sequence[RunRow], a: str, b: str) -> bool:
    """Whether fields a and b vary together over the rows: each takes two values or more, and
    one fixes the other (a zip of them; a param and the kernel it belongs to) or a table of a
    against b would fill half its cells or fewer (two params of one kernel each: each run sets
    one, the other unset): a mostly empty diagonal."""
    pairs = {(_text(_axis_value(r, a)), _text(_axis_value(r, b))) for r in rows}
    firsts, seconds = {x for x, _ in pairs}, {y for _, y in pairs}
    if len(firsts) < 2 or len(seconds) < 2:
        return False
    fixed = len(pairs) in (len(firsts), len(seconds))
    return fixed or 2 * len(pairs) <= len(firsts) * len(seconds)


def _row_text(row: RunRow, name: str, beside: Sequence[str]) -> str:
    """A pivot row's name: the rows field's value, then each field that varies with it
    ("1,024 · W=2"); an unset value is left out ("-" when all are)."""
    value = _axis_value(row, name)
    parts = [] if value is None else [_shown(value)]
    parts += [t for b in beside if (t := _column_text(row, [b])) != "-"]
    return " · ".join(parts) or "-"


def _pivot_layout(measured: Sequence[RunRow], spec: PivotSpec) -> tuple[list[str], ...]:
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


def pivot(rows: Sequence[RunRow], spec: PivotSpec) -> Pivot:
    """The metric spec.value for every (row value, column values) pair of the rows, one
    section per combination of what else varies (so two runs never share one cell); what else
    varies but fills different columns per value (the kernel of a dense-vs-ring
    sweep) joins the columns instead, and a column field varying together with the rows field
    joins the rows (_pivot_layout): never a mostly empty diagonal."""
    measured = [r for r in rows if getattr(r, spec.value) is not None]
    fields, columns, beside = _pivot_layout(measured, spec)
    cells: dict[tuple[str, Any], dict[str, Any]] = {}
    row_keys: dict[tuple[str, Any], tuple[Any, ...]] = {}
    flagged: dict[tuple[str, Any], dict[str, list[str]]] = {}
    col_keys: dict[str, tuple[Any, ...]] = {}
    sec_keys: dict[str, tuple[Any, ...]] = {}
    sec_values: dict[str, list[str]] = {}
    for r in rows:
        title = _section_title(r, fields)
        sec_keys[title] = tuple(_sort_key(_axis_value(r, f)) for f in fields)
        sec_values[title] = [_section_value(r, f) for f in fields]
        ctext = _column_text(r, columns) if columns else PIVOT_VALUES[spec.value]
        col_keys[ctext] = tuple(_sort_key(_axis_value(r, c)) for c in columns)
        key = (title, _row_text(r, spec.rows, beside))
        row_keys[key] = tuple(_sort_key(_axis_value(r, f)) for f in (spec.rows, *beside))
        cells.setdefault(key, {})[ctext] = getattr(r, spec.value)
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
