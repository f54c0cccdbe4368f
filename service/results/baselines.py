"""What a sweep's rows are compared against: baselines and ratios (readable labels are
service.results.labels', the pivot service.results.pivot's; both are read through here too).

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

Whatever the baseline, a run over W > 1 ranks is also paired with its single-process partner
(the default W=1 baseline's pairing, Refs.single_process): one process' time over W is the
ideal its `ideal_fraction` reads (service.results.work_share).

A ratio above its physical limit is flagged (views.Flag), never shown plainly: against the same
work on fewer ranks (same_work), a speedup above the world-size ratio (W / baseline W) beyond
its interval
(speedup_above_world_size), and so a scaling efficiency above 100% beyond its interval
(efficiency_above_100; for a max_seq_len run, a max-length gain above the world-size ratio).
Without an interval (one iteration) a ratio above its limit is flagged all the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import attention
from service.results.labels import (
    Varying,
    given_params,
    label,
    series_label,
    set_labels,
    value_text,
    varying,
)
from service.results.pivot import (
    PIVOT_VALUES,
    Pivot,
    PivotSection,
    pivot,
    pivot_spec,
)
from service.results.rows import Flag, RunRow
from service.results.work_share import ideal_fraction
from service.spec import NESTED, AnalysisSpec, nested_axis
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

__all__ = [
    "DENSE_KERNELS", "IGNORED_FOR_MATCHING", "PIVOT_VALUES", "Pivot", "PivotSection",
    "ReferenceFinder", "Refs", "Varying", "apply", "fill", "label", "limit_flags", "pivot",
    "pivot_spec", "references", "same_work", "series_label", "set_labels", "varying",
]  # fmt: skip
"""What this module serves: its own baselines and ratios, the labels' and the pivot's names."""


def _match_key(config: dict[str, Any]) -> str:
    kept = {k: v for k, v in config.items() if k not in IGNORED_FOR_MATCHING}
    # A param set to None is the kernel's own default, as if unset: a cell stored before the
    # kernel gained that param (dense's document_lengths) still matches one stored after.
    # So is a value resolved from the default when the run was expanded (workers.resolved).
    kept["params"] = given_params(kept)
    if kept.get("world_size", 1) == 1:
        kept["parallel"] = "sequence"  # one rank: data and sequence parallel are the same run
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)


def _with(config: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """The config with fields (or `params.<name>`, `model.<name>`, `training.<name>`) replaced."""
    out = dict(config)
    out["params"] = given_params(config)  # the params as given: the changed kernel's resolve anew
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
            dense = attention.exact_dense()
            changes = {"kernel": dense, "params": _mask_only(dense, row.params)}
        else:
            return []
    world = changes.get("world_size")
    rest = {k: v for k, v in changes.items() if k != "world_size"}
    name = ", ".join(
        f"{k.split('.', 1)[-1]}={'none' if v is None else value_text(v)}"
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
            params = taken_params(twin, attention.twin_params(target["params"]))
            if params is not None:
                out.append(({**target, "kernel": twin, "params": params}, f"{twin} {tname}"))
    return out


ORDER_PARAMS = frozenset({"balance", "gather"})
"""Params that only order a sharded kernel's work over its ranks (`balance`,
attention.layouts.order) or route its K/V between them (allgather_kv's `gather`): the same
attention without them is the same result, so a kernel that does not take them (a sharded
kernel's dense twin) is the same work."""


def taken_params(kernel: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """`params` as `kernel` takes them: ORDER_PARAMS it does not take dropped (a ring with a
    balance has its dense twin as baseline, `mask` kept: dense takes it); None when a param it
    does not take changes what is computed (no such run can be the same work)."""
    spec = attention.KERNELS.get(kernel)
    if spec is None:
        return params
    fields = {f.name for f in dataclasses.fields(spec.params) if f.init}
    dropped = {k for k, v in params.items() if k not in fields and v is not None}
    if dropped - ORDER_PARAMS:
        return None
    return {k: v for k, v in params.items() if k in fields}


def _mask_only(kernel: str, params: dict[str, Any]) -> dict[str, Any]:
    """The params of a dense baseline for a run of another kernel: the run's `mask` when it has
    one and `kernel` takes it (the same mask's dense attention), else none."""
    mask = params.get("mask")
    if mask is None or (taken_params(kernel, {"mask": mask}) or {}).get("mask") is None:
        return {}
    return {"mask": mask}


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass(frozen=True)
class Refs:
    """The other runs of its sweep a run is compared against, found from configs alone."""

    baseline: tuple[int, str] | None = None
    """(run id, name) of its baseline."""
    without_checkpointing: int | None = None
    """A model run with checkpointing: the same cell without it."""
    single_process: int | None = None
    """A run over W > 1 ranks: the same cell at world size 1 (the kernel's single-process twin
    when the sweep has no W=1 run of the kernel itself), whatever the sweep's baseline: the
    one process whose time over W is the ideal (service.results.work_share.ideal_fraction)."""


SINGLE_PROCESS = AnalysisSpec(baseline={"world_size": 1})
"""What finds a run's single-process partner: the default baseline of a W > 1 cell, under
strong scaling (the same global work)."""


def _single_process_targets(row: RunRow) -> list[bytes]:
    """Digests of the configs that would be the run's single-process partner, best first
    (the same work only: a data-parallel cell's weak fallback is one rank's share)."""
    if row.world_size <= 1:
        return []
    return [_digest(t) for t, name in _targets(row, SINGLE_PROCESS) if not name.endswith("(weak)")]


class ReferenceFinder:
    """Finds every run's Refs in one pass over a sweep's rows in id order (results not needed),
    keeping per run only short digests of the configs it looks for: a 100,000-run sweep is
    resolved without holding its rows."""

    def __init__(self, spec: AnalysisSpec | None) -> None:
        self.spec = spec or AnalysisSpec()
        self.first: dict[bytes, int] = {}  # match key -> the lowest run id with it
        self.wanted: list[tuple[int, list[tuple[bytes, str]], bytes | None, list[bytes]]] = []

    def add(self, row: RunRow) -> None:
        """One row (rows come in id order)."""
        self.first.setdefault(_digest(row.config), row.run_id)
        targets = [(_digest(t), name) for t, name in _targets(row, self.spec)]
        plain = None
        checkpointing = (row.config.get("training") or {}).get("checkpointing")
        if row.workload == "model" and checkpointing not in (None, "none"):
            changes = {"training.checkpointing": "none", "training.checkpoint_every": None}
            plain = _digest(_with(row.config, changes))
        single = _single_process_targets(row)
        if targets or plain is not None or single:
            self.wanted.append((row.run_id, targets, plain, single))

    def refs(self) -> dict[int, Refs]:
        """Run id -> Refs for every run that has a reference."""
        out = {}
        for run_id, targets, plain, single in self.wanted:
            found = [(self.first[k], name) for k, name in targets if k in self.first]
            without = self.first.get(plain) if plain is not None else None
            one = next((self.first[k] for k in single if k in self.first), None)
            if found or without is not None or one is not None:
                out[run_id] = Refs(found[0] if found else None, without, one)
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
        if ref.single_process is not None and not r.searched:  # a search times its own answer
            one = by_id[ref.single_process]
            r.ideal_run_id = one.run_id
            r.ideal_fraction = ideal_fraction(r.median_s, r.world_size, one.median_s)
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
    as_twin = taken_params(base.kernel, attention.twin_params(row.params))
    if as_twin is None:
        return False
    return {k: v for k, v in as_twin.items() if v is not None} == base_params


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
