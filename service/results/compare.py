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
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from service.results.rows import RunRow, median_interval
from service.spec import canonical_json
from workers.noise import CONFIDENCE, Interval, ratio_interval

MEMORY_TOLERANCE = 0.10
"""Peak memory and maximum length have no repeats to give a spread: a change counts beyond this."""


@dataclass(frozen=True, slots=True)
class Side:
    """One run as a comparison reads it: the fields of its RunRow that the API and the page
    show, with its time's and tokens/s's intervals. Made from its Sides record when a pair
    reads it, and dropped with the pair."""

    run_id: int
    label: str
    length: int
    status: str
    median_s: float | None
    median_lo_s: float | None
    median_hi_s: float | None
    median_ci_level: float | None
    iterations: int | None
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    max_seq_len: int | None
    time_interval: Interval | None
    """RunRow.time_interval."""
    tokens_per_s_interval: Interval | None
    """RunRow.tokens_per_s_interval."""


_RECORD = struct.Struct("<qqIIH8d3q")
"""A run's record in Sides: run id, length, label and status (indexes in Sides' texts), a bit
per optional value that is None, then the optional values: median_s, median_lo_s, median_hi_s,
median_ci_level, tokens_per_s, the tokens/s interval's lo, hi and level (floats), iterations,
peak_memory_bytes and max_seq_len (ints)."""
_KEY = struct.Struct("16s")
"""A run's cell key (RunRow.cell_key) as its 16-byte BLAKE2b digest."""


class Sides:
    """Every run of one sweep as a comparison reads it, in the order added, packed: a
    fixed-size record a run (_RECORD, 114 bytes) in one buffer and its cell key's digest in
    another, its label and status as indexes in a table of the distinct texts. Held as Side
    objects (~600 bytes a run in a dozen small ones), two 100,000-run sweeps filled ~100 MiB
    of the allocator's arenas, and the few objects that outlive a read kept most of them after
    the answer; two buffers are given back whole."""

    def __init__(self, rows: Iterable[RunRow] = ()) -> None:
        """The sides of `rows` (built, their labels set), in their order; more with add()."""
        self._records = bytearray()
        self._keys = bytearray()
        self._texts: list[str] = []
        self._text_ids: dict[str, int] = {}
        for row in rows:
            self.add(row)

    def add(self, row: RunRow) -> None:
        """Append a built row's side (its label already set)."""
        tps = row.tokens_per_s_interval
        optional = (
            row.median_s, row.median_lo_s, row.median_hi_s, row.median_ci_level,
            row.tokens_per_s, *((None,) * 3 if tps is None else (tps.lo, tps.hi, tps.level)),
            row.iterations, row.peak_memory_bytes, row.max_seq_len,
        )  # fmt: skip
        missing = sum(1 << i for i, v in enumerate(optional) if v is None)
        values = (0 if v is None else v for v in optional)
        label, status = self._text(row.label), self._text(row.status)
        self._records += _RECORD.pack(row.run_id, row.length, label, status, missing, *values)
        self._keys += hashlib.blake2b(row.cell_key.encode(), digest_size=16).digest()

    def _text(self, text: str) -> int:
        found = self._text_ids.get(text)
        if found is None:
            found = self._text_ids[text] = len(self._texts)
            self._texts.append(text)
        return found

    def __len__(self) -> int:
        return len(self._keys) // _KEY.size

    def side(self, i: int) -> Side:
        """The i-th run added, as a Side."""
        run_id, length, label, status, missing, *values = _RECORD.unpack_from(
            self._records, i * _RECORD.size
        )
        v = [None if missing >> k & 1 else x for k, x in enumerate(values)]
        median_s, lo, hi, level, tps, _, _, _, iterations, peak, max_len = v
        tps_interval = None if missing >> 5 & 1 else Interval(*values[5:8])
        return Side(
            run_id=run_id, label=self._texts[label], length=length, status=self._texts[status],
            median_s=median_s, median_lo_s=lo, median_hi_s=hi, median_ci_level=level,
            iterations=iterations, tokens_per_s=tps, peak_memory_bytes=peak, max_seq_len=max_len,
            time_interval=median_interval(lo, hi, level),
            tokens_per_s_interval=tps_interval,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Side]:
        return (self.side(i) for i in range(len(self)))

    def keys(self) -> Iterator[bytes]:
        """Each run's cell key digest, in order."""
        return (key for (key,) in _KEY.iter_unpack(self._keys))


def matches(a: Sides, b: Sides) -> Iterator[tuple[int, int]]:
    """(i, j) for A's run i and B's run j of the same cell, in A's order; of B's runs of one
    cell, the last."""
    b_at = {key: j for j, key in enumerate(b.keys())}
    for i, key in enumerate(a.keys()):
        j = b_at.get(key)
        if j is not None:
            yield i, j


def unmatched(a: Sides, b: Sides) -> tuple[int, int]:
    """How many cells are only in A, and only in B (no run with the same config in the other)."""
    a_keys, b_keys = set(a.keys()), set(b.keys())
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


def too_few(side: Side) -> bool:
    """Whether a measured run's median interval cannot tell a change: none (one iteration) or
    below CONFIDENCE (2-5 iterations)."""
    interval = side.time_interval
    return side.median_s is not None and (interval is None or interval.level < CONFIDENCE)


def time_verdict(a: Side, b: Side) -> str | None:
    """'slower', 'faster', 'within noise' or TOO_FEW for a time measured in both runs (None
    when one has no time): the stated level is CONFIDENCE, never less."""
    if a.median_s is None or b.median_s is None:
        return None
    if too_few(a) or too_few(b):
        return TOO_FEW
    return time_change(a, b) or "within noise"


def time_change(a: Side, b: Side) -> str | None:
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


def compare_rows(a_rows: Iterable[RunRow], b_rows: Iterable[RunRow]) -> list[dict[str, Any]]:
    """Pairs of runs with the same config in sweeps A and B, with B/A ratios and a verdict
    (iter_pairs, kept)."""
    return list(iter_pairs(Sides(a_rows), Sides(b_rows)))


def iter_pairs(a: Sides, b: Sides) -> Iterator[dict[str, Any]]:
    """Pairs of runs with the same config in sweeps A and B, in A's order, with B/A ratios and
    a verdict, one at a time (pair)."""
    for i, j in matches(a, b):
        yield pair(a.side(i), b.side(j))


def pair(a: Side, b: Side) -> dict[str, Any]:
    """Runs a and b of one cell, with B/A ratios and a verdict.

    Regression: B slower beyond both spreads at CONFIDENCE (time_change), B's peak memory
    above A's or its maximum length below A's by more than MEMORY_TOLERANCE, or A succeeded
    and B did not.
    """
    tol = MEMORY_TOLERANCE
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
    return {
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


def compare_head(a_id: int, b_id: int, a: Sides, b: Sides, same: bool) -> dict[str, Any]:
    """The comparison's fields before its pairs (GET /api/v1/sweeps/{a}/compare/{b}): the
    pairs are counted one at a time, none kept."""
    only_a, only_b = unmatched(a, b)
    regressions = within_noise = too_few_ = 0
    for p in iter_pairs(a, b):
        regressions += p["regression"]
        within_noise += p["within_noise"]
        too_few_ += p["time_verdict"] == TOO_FEW
    return {"a": a_id, "b": b_id, "same_spec": same, "only_a": only_a, "only_b": only_b,
            "regressions": regressions, "within_noise": within_noise,
            "too_few": too_few_}  # fmt: skip


def compare_out(a_id: int, b_id: int, a_rows: Iterable[RunRow], b_rows: Iterable[RunRow],
                same: bool) -> dict[str, Any]:  # fmt: skip
    """The comparison of two sweeps' rows as plain JSON values, whole: compare_head and every
    pair_out."""
    a, b = Sides(a_rows), Sides(b_rows)
    pairs = [pair_out(p) for p in iter_pairs(a, b)]
    return {**compare_head(a_id, b_id, a, b, same), "pairs": pairs}
