"""The compare page's logic on the one read model (service.results.rows rows): matching cells of two
sweeps, their B/A ratios and a verdict that respects the measured noise.

A time changed only when the two runs' median intervals (service.results.rows: the slowest rank's
order-statistic interval, at the level its iteration count gives) do not overlap, so the B/A
tokens/s interval (both spreads: b_lo / a_hi .. b_hi / a_lo) excludes 1.0, and only when both
intervals reach CONFIDENCE (95%: 6 iterations or more). Below that (2-5 iterations: the range of
all samples, 50%-94%; one iteration: no interval) two ranges miss each other too often by chance
to call a change: such a cell is "too few iterations to tell", never slower nor faster. Two
sweeps whose specs are identical but for their names ran the same cells: a difference between
them comes from the code or the machine, not from the experiment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from service.results.rows import RunRow, median_interval
from service.spec import canonical_json
from workers.noise import CONFIDENCE, Interval, inverse, ratio_interval

MEMORY_TOLERANCE = 0.10
"""Peak memory and maximum length have no repeats to give a spread: a change counts beyond this."""


class Compared(Protocol):
    """What a comparison reads of a run: a RunRow, or its Side (a big sweep's compact form)."""

    @property
    def run_id(self) -> int: ...
    @property
    def label(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def cell_key(self) -> Hashable: ...
    @property
    def status(self) -> str: ...
    @property
    def median_s(self) -> float | None: ...
    @property
    def median_lo_s(self) -> float | None: ...
    @property
    def median_hi_s(self) -> float | None: ...
    @property
    def median_ci_level(self) -> float | None: ...
    @property
    def iterations(self) -> int | None: ...
    @property
    def tokens_per_s(self) -> float | None: ...
    @property
    def peak_memory_bytes(self) -> int | None: ...
    @property
    def max_seq_len(self) -> int | None: ...
    @property
    def time_interval(self) -> Interval | None: ...
    @property
    def tokens_per_s_interval(self) -> Interval | None: ...


@dataclass(frozen=True, slots=True)
class Side:
    """One run as a comparison reads it: the fields of its RunRow that the API and the page
    show, and its cell key as a 16-byte digest. A side costs a few hundred bytes where its row
    costs ~7 KB, so two 100,000-run sweeps' sides fit in memory where their rows would not."""

    run_id: int
    label: str
    length: int
    cell_key: bytes
    status: str
    median_s: float | None
    median_lo_s: float | None
    median_hi_s: float | None
    median_ci_level: float | None
    iterations: int | None
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    max_seq_len: int | None
    tokens: int | None
    """batch_size x measured length (None: nothing measured): tokens/s's numerator."""

    @classmethod
    def of(cls, row: RunRow) -> Side:
        """The side of a built row (its label already set)."""
        measured = row.measured_seq_len
        return cls(
            run_id=row.run_id, label=row.label, length=row.length,
            cell_key=hashlib.blake2b(row.cell_key.encode(), digest_size=16).digest(),
            status=row.status, median_s=row.median_s, median_lo_s=row.median_lo_s,
            median_hi_s=row.median_hi_s, median_ci_level=row.median_ci_level,
            iterations=row.iterations, tokens_per_s=row.tokens_per_s,
            peak_memory_bytes=row.peak_memory_bytes, max_seq_len=row.max_seq_len,
            tokens=None if measured is None else row.batch_size * measured,
        )  # fmt: skip

    @property
    def time_interval(self) -> Interval | None:
        """As RunRow.time_interval."""
        return median_interval(self.median_lo_s, self.median_hi_s, self.median_ci_level)

    @property
    def tokens_per_s_interval(self) -> Interval | None:
        """As RunRow.tokens_per_s_interval."""
        if self.tokens is None:
            return None
        return inverse(self.time_interval, self.tokens)


def unmatched(a_rows: Sequence[Compared], b_rows: Sequence[Compared]) -> tuple[int, int]:
    """How many cells are only in A, and only in B (no run with the same config in the other)."""
    a_keys = {r.cell_key for r in a_rows}
    b_keys = {r.cell_key for r in b_rows}
    return len(a_keys - b_keys), len(b_keys - a_keys)


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


SPEC_NAME_FIELDS = ("name",)
"""What two specs may differ in and still be the same experiment."""


def same_spec(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two sweeps' specs are identical once their names are dropped."""
    if a is None or b is None:
        return False

    def kept(spec: dict[str, Any]) -> str:
        return canonical_json({k: v for k, v in spec.items() if k not in SPEC_NAME_FIELDS})

    return kept(a) == kept(b)


TOO_FEW = "too few iterations to tell"
"""The verdict on a time when a run's interval is missing or covers less than CONFIDENCE."""


def too_few(row: Compared) -> bool:
    """Whether a measured run's median interval cannot tell a change: none (one iteration) or
    below CONFIDENCE (2-5 iterations)."""
    interval = row.time_interval
    return row.median_s is not None and (interval is None or interval.level < CONFIDENCE)


def time_verdict(a: Compared, b: Compared) -> str | None:
    """'slower', 'faster', 'within noise' or TOO_FEW for a time measured in both runs (None
    when one has no time): the stated level is CONFIDENCE, never less."""
    if a.median_s is None or b.median_s is None:
        return None
    if too_few(a) or too_few(b):
        return TOO_FEW
    return time_change(a, b) or "within noise"


def time_change(a: Compared, b: Compared) -> str | None:
    """'slower' or 'faster' when B's median interval lies wholly above or below A's, both at
    CONFIDENCE or more, else None (they overlap: within the noise; or a run's interval is
    missing or below CONFIDENCE: too few iterations to tell)."""
    ia, ib = a.time_interval, b.time_interval
    if ia is None or ib is None or min(ia.level, ib.level) < CONFIDENCE:
        return None
    if ib.lo > ia.hi:
        return "slower"
    if ib.hi < ia.lo:
        return "faster"
    return None


def compare_rows(a_rows: Sequence[Compared], b_rows: Sequence[Compared]) -> list[dict[str, Any]]:
    """Pairs of runs with the same config in sweeps A and B, with B/A ratios and a verdict
    (iter_pairs, kept)."""
    return list(iter_pairs(a_rows, b_rows))


def iter_pairs(a_rows: Sequence[Compared], b_rows: Sequence[Compared]) -> Iterator[dict[str, Any]]:
    """Pairs of runs with the same config in sweeps A and B, in A's order, with B/A ratios and
    a verdict, one at a time.

    Regression: B slower beyond both spreads at CONFIDENCE (time_change), B's peak memory
    above A's or its maximum length below A's by more than MEMORY_TOLERANCE, or A succeeded
    and B did not.
    """
    b_by_key = {r.cell_key: r for r in b_rows}
    tol = MEMORY_TOLERANCE
    for a in a_rows:
        b = b_by_key.get(a.cell_key)
        if b is None:
            continue
        tps = _ratio(b.tokens_per_s, a.tokens_per_s)
        tps_spread = ratio_interval(b.tokens_per_s_interval, a.tokens_per_s_interval)
        mem = _ratio(b.peak_memory_bytes, a.peak_memory_bytes)
        maxlen = _ratio(b.max_seq_len, a.max_seq_len)
        change = time_change(a, b)
        reasons = []
        if a.status == "succeeded" and b.status != "succeeded":
            reasons.append(f"B {b.status}")
        if change == "slower":
            reasons.append("slower")
        if mem is not None and mem > 1 + tol:
            reasons.append("more memory")
        if maxlen is not None and maxlen < 1 - tol:
            reasons.append("shorter max length")
        yield (
            {
                "label": f"{a.label} · seq {a.length:,}",
                "a": a,
                "b": b,
                "time_ratio": _ratio(b.median_s, a.median_s),
                "tps_ratio": tps,
                "tps_lo": None if tps_spread is None else tps_spread.lo,
                "tps_hi": None if tps_spread is None else tps_spread.hi,
                "within_noise": tps_spread is not None and tps_spread.holds(1.0),
                "time_change": change,
                "time_verdict": time_verdict(a, b),
                "memory_ratio": mem,
                "max_len_ratio": maxlen,
                "regression": bool(reasons),
                "reasons": reasons,
            }
        )


PAIR_KEEP = ("label", "tps_ratio", "tps_lo", "tps_hi", "within_noise", "time_change",
             "time_verdict", "memory_ratio", "max_len_ratio", "regression", "reasons",
             "time_ratio")  # fmt: skip
"""What the API keeps of a pair (iter_pairs), besides each side's run id and PAIR_VALUES."""
PAIR_VALUES = ("status", "median_s", "tokens_per_s", "peak_memory_bytes", "max_seq_len",
               "iterations", "median_ci_level")  # fmt: skip
"""Each side's fields the API gives for a pair, as a_<field> and b_<field>."""


def pair_out(p: dict[str, Any]) -> dict[str, Any]:
    """One pair (iter_pairs) as plain JSON values."""
    return {
        "a_run_id": p["a"].run_id,
        "b_run_id": p["b"].run_id,
        **{k: p[k] for k in PAIR_KEEP},
        **{f"a_{v}": getattr(p["a"], v) for v in PAIR_VALUES},
        **{f"b_{v}": getattr(p["b"], v) for v in PAIR_VALUES},
    }


def compare_head(a_id: int, b_id: int, a_rows: Sequence[Compared], b_rows: Sequence[Compared],
                 same: bool) -> dict[str, Any]:  # fmt: skip
    """The comparison's fields before its pairs (GET /api/v1/sweeps/{a}/compare/{b}): the
    pairs are counted one at a time, none kept."""
    only_a, only_b = unmatched(a_rows, b_rows)
    regressions = within_noise = too_few_ = 0
    for p in iter_pairs(a_rows, b_rows):
        regressions += p["regression"]
        within_noise += p["within_noise"]
        too_few_ += p["time_verdict"] == TOO_FEW
    return {"a": a_id, "b": b_id, "same_spec": same, "only_a": only_a, "only_b": only_b,
            "regressions": regressions, "within_noise": within_noise,
            "too_few": too_few_}  # fmt: skip


def compare_out(a_id: int, b_id: int, a_rows: Sequence[Compared], b_rows: Sequence[Compared],
                same: bool) -> dict[str, Any]:  # fmt: skip
    """The comparison as plain JSON values, whole: compare_head and every pair_out."""
    pairs = [pair_out(p) for p in iter_pairs(a_rows, b_rows)]
    return {**compare_head(a_id, b_id, a_rows, b_rows, same), "pairs": pairs}
