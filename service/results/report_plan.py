"""report.md's first pass over a sweep's runs: what the report must know of every run before it
writes a line of a table (service.results.report writes them in a second pass).

One pass in id order, a run at a time, keeping a few hundred bytes a run where its row holds
~3 KB: the totals and notes of the heading (setup, intervals, errors, warnings, footnotes), the
time unit's medians, the results table's columns (report_runs.ResultsLayout), the report's row
order, the baselines the comparisons name, and each run as its pivot reads it (PivotRow). A
100,000-run sweep's report is so written from two reads of its rows, never holding them all.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

from service.results.labels import AXIS_CONFIG_FIELDS, PIVOT_ROW_COPIES, PivotRow, value_text
from service.results.report_runs import ResultsLayout
from service.results.rows import Flag, RunRow
from service.spec import PivotSpec, canonical_json, nested_axis
from service.units import TimeUnit, natural_key, time_unit
from workers.noise import CONFIDENCE

SETUP_FIELDS = ("batch_size", "num_heads", "head_dim", "dtype", "causal", "mode", "parallel")
PROTOCOL_FIELDS = ("device", "warmup", "iterations", "placement", "fresh_processes")


def pivot_fields(spec: PivotSpec | None) -> frozenset[str]:
    """The config fields a pivot row keeps: AXIS_CONFIG_FIELDS and the fields the pivot's
    own rows and columns name (a nested axis: its object)."""
    named = [] if spec is None else [spec.rows, *spec.columns]
    own = {(nested_axis(n) or (n, ""))[0] for n in named}
    return AXIS_CONFIG_FIELDS | own


class ReportPlan:
    """The first pass (add() each run, in id order): every figure report.md states of the
    sweep as a whole, and what its second pass needs to write the tables a line at a time."""

    def __init__(self, metric: str, fields: frozenset[str]) -> None:
        """`metric`: the field the pivot shows; `fields`: the config fields it reads
        (pivot_fields)."""
        self.runs = 0
        self.errors: list[str] = []
        """A line per failed run (an error stored)."""
        self.first_config: dict[str, Any] = {}
        self.config_texts: dict[str, set[str]] = {f: set() for f in SETUP_FIELDS + PROTOCOL_FIELDS}
        self.kernels: dict[str, dict[str, str]] = {}
        """Each kernel's params every one of its runs shares, as text."""
        self.timed = 0
        self.iterations: set[int] = set()
        self.ci_levels: set[float] = set()
        self.no_interval = False
        self.below_confidence = False
        self.medians = array("d")
        """Every measured median (seconds): the report's time unit."""
        self.flagged = 0
        self.footnotes: dict[str, list[str]] = {}
        """Flag code -> a sentence per run it marks, in id order."""
        self.cotenants: list[tuple[int, list[int]]] = []
        self.bench = 0
        """Runs timed at their cell's length (not searches): the results table's."""
        self.layout = ResultsLayout()
        self.baseline_ids: set[int] = set()
        """Runs some run is compared against (Against the baseline)."""
        self._order: list[tuple[tuple[Any, ...], int, int]] = []
        self._label_keys: dict[str, tuple[Any, ...]] = {}
        self.pivot_rows: list[PivotRow] = []
        self._metric = metric
        self._fields = fields
        self._labels: dict[str, str] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self._params: dict[str, dict[str, Any]] = {}
        """One object per distinct label, config and params (by canonical JSON), shared by the
        pivot rows: a large sweep's runs repeat a few of each (its configs here leave out the
        length and whatever else no axis reads)."""

    def add(self, r: RunRow) -> None:
        """Count the run into every total, in id order."""
        if self.runs == 0:
            self.first_config = {f: r.config.get(f) for f in self.config_texts}
            for name, seen in self.config_texts.items():
                seen.add(canonical_json(self.first_config[name]))
        self.runs += 1
        if r.error:
            self.errors.append(_error_line(r))
        for name, seen in self.config_texts.items():
            if len(seen) < 2:  # past two texts a field is not fixed, whatever comes after
                value = r.config.get(name)
                if not _same_scalar(value, self.first_config[name]):
                    seen.add(canonical_json(value))
        self._add_kernel(r)
        if r.median_s is not None:
            self._add_timed(r)
        if r.flags:
            self.flagged += 1
            for f in r.flags:
                self.footnotes.setdefault(f.code, []).append(
                    f"run {r.run_id} ({r.label}, seq {r.length:,}): {f.text}"
                )
        if r.cotenants:
            self.cotenants.append((r.run_id, sorted(r.cotenants)))
        if not r.searched:
            self.bench += 1
            self.layout.add(r)
        if r.baseline_run_id is not None:
            self.baseline_ids.add(r.baseline_run_id)
        key = self._label_keys.get(r.label)
        if key is None:
            key = self._label_keys[r.label] = natural_key(r.label)
        self._order.append((key, r.length, r.run_id))
        self.pivot_rows.append(self._pivot_row(r))

    def _add_kernel(self, r: RunRow) -> None:
        params = {k: value_text(v) for k, v in r.params.items() if v is not None}
        if r.kernel not in self.kernels:
            self.kernels[r.kernel] = params
        else:
            seen = self.kernels[r.kernel]
            self.kernels[r.kernel] = {k: v for k, v in seen.items() if params.get(k) == v}

    def _add_timed(self, r: RunRow) -> None:
        assert r.median_s is not None
        self.timed += 1
        self.medians.append(r.median_s)
        if r.iterations is not None:
            self.iterations.add(r.iterations)
        if r.median_ci_level is None:
            self.no_interval = True
        else:
            self.ci_levels.add(r.median_ci_level)
        if r.median_ci_level is None or r.median_ci_level < CONFIDENCE:
            self.below_confidence = True

    def _pivot_row(self, r: RunRow) -> PivotRow:
        config = {k: v for k, v in r.config.items() if k in self._fields}
        flags: tuple[Flag, ...] = tuple(r.flags)
        return PivotRow(
            label=self._labels.setdefault(r.label, r.label),
            **{name: getattr(r, name) for name in PIVOT_ROW_COPIES},
            config=self._configs.setdefault(canonical_json(config), config),
            params=self._params.setdefault(canonical_json(r.params), r.params),
            flags=flags,
            metric_name=self._metric,
            metric=getattr(r, self._metric),
        )

    def fixed(self, fields: Iterable[str]) -> dict[str, Any]:
        """The fields every run shares, with their value (as the first run has it)."""
        return {
            f: self.first_config[f] for f in fields if self.runs and len(self.config_texts[f]) == 1
        }

    def unit(self) -> TimeUnit:
        """The one time unit of every table of the report, from all its runs' medians: a run's
        time reads the same in each table (not "1.45 s" in one and "1,446.6 ms" in the next)."""
        return time_unit(self.medians)

    def order(self) -> list[int]:
        """The run ids in the report's row order: by label with its numbers read as numbers
        ("2,048" before "4,096"), then length, then run id."""
        return [run_id for _, _, run_id in sorted(self._order)]


def _same_scalar(value: Any, first: Any) -> bool:
    """Whether `value` is `first` as JSON without writing either: a str, int, bool or None of
    the same type and equal (a float or a container is compared by its canonical JSON)."""
    return type(value) is type(first) and isinstance(value, str | int | None) and value == first


def _error_line(r: RunRow) -> str:
    text = (r.error or "").strip()
    first = text.splitlines()[0] if text else "-"
    return f"- run {r.run_id} ({r.label}, seq_len {r.seq_len:,}, {r.status}): {first}"
