"""Each rank's share of a run's work, and the run against one process doing all of it: pure
functions of a run's ranks (and of its single-process partner's time), so the run page,
results.json and report.md's "Packed documents: balance and schemes" share one definition.

- kept-pairs imbalance: max / mean over the ranks of kept_pairs (the query-key pairs each rank's
  plan computes per iteration under the run's mask and balance, summed over the heads: the
  kernel's own rank_pairs, workers.kernels.kept_pairs). None where a rank did not count its
  pairs (single-process kernels, ulysses: every rank the whole sequence for its heads) or none
  were kept.
- measured compute imbalance: max / mean over the ranks of their compute seconds. The compute
  seconds are the step clock's (attention.ring.steps; RankResult.step_compute_s: every step's
  time minus its waits on transfers, summed over the steps and the timed iterations), for every
  kernel that has one: ring, ring_block_sparse and ring_dilated (their ring steps), allgather_kv
  (one step per phase: its gather and the attention over the gathered K/V, the gather's wait
  taken out), ulysses and usp (the all-to-all steps and the inner kernel's). A kernel without a
  step clock (single-process kernels) has none: no other clock stands in for it.
- TFLOP/s from the kept pairs: forward FLOPs = 4 x head_dim x kept pairs summed over the ranks
  x the batch rows each rank holds (attention.base.attention_flops), backward =
  BACKWARD_FLOP_FACTOR (2.5) x forward, as flash attention counts them; each over the slowest
  rank's time in its phase (max over the ranks of forward_s, backward_s; in forward mode the
  forward's over the slowest rank's median iteration, and no backward).
- % of ideal: the time one process takes for the same work, divided by W, over the run's time
  (the slowest rank's median): (T_1 / W) / T_W. T_1 is the median time of the run's
  single-process partner: the same cell at world size 1 (same mask, length, dtype, shape and
  mode; a ring kernel's single-process twin when the sweep has no W=1 run of the kernel
  itself), found by the baselines' own pairing (service.results.baselines.Refs.single_process).
  None without such a run, or without its time (it failed): never a guessed number; none for
  a max_seq_len search (each side is timed at its own answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from attention.base import BACKWARD_FLOP_FACTOR, attention_flops
from service.results.rows import RunRow
from workers.results import RankResult

Phase = Literal["forward", "backward"]


def imbalance(values: Sequence[float | int | None]) -> float | None:
    """max / mean of `values` (1.0: an even share); None when any is missing or all are 0."""
    if not values or any(v is None for v in values):
        return None
    known = [float(v) for v in values if v is not None]
    mean = sum(known) / len(known)
    return max(known) / mean if mean > 0 else None


def kept_pairs_imbalance(ranks: Sequence[RankResult]) -> float | None:
    """The kept query-key pairs' max / mean over the ranks (see the module docstring)."""
    return imbalance([r.kept_pairs for r in ranks])


def compute_imbalance(ranks: Sequence[RankResult]) -> float | None:
    """The step clock's compute seconds' max / mean over the ranks; None for a kernel without
    a step clock (see the module docstring)."""
    return imbalance([r.step_compute_s for r in ranks])


def wasted_comm_share(ranks: Sequence[RankResult]) -> float | None:
    """The share of the K/V bytes the ranks received that carried no kept pair: their
    wasted_comm_bytes over their comm_bytes, summed over the ranks; None for a kernel that
    does not count them (every rank must) or that received nothing."""
    comm = [r.comm_bytes for r in ranks]
    wasted = [r.wasted_comm_bytes for r in ranks]
    if not ranks or None in comm or None in wasted:
        return None
    total = sum(c for c in comm if c is not None)
    return sum(w for w in wasted if w is not None) / total if total else None


def local_batch(parallel: str, world_size: int, batch_size: int) -> int:
    """Batch rows one rank holds (workers.config.RunConfig.local_batch)."""
    return batch_size // world_size if parallel == "data" else batch_size


def kept_flops(ranks: Sequence[RankResult], head_dim: int, batch_rows: int) -> float | None:
    """Forward FLOPs of one iteration from the kept pairs, summed over the ranks (None when a
    rank did not count its pairs)."""
    pairs = [r.kept_pairs for r in ranks]
    if not pairs or any(p is None for p in pairs):
        return None
    return float(attention_flops(batch_rows * sum(p for p in pairs if p is not None), head_dim))


def phase_time(ranks: Sequence[RankResult], phase: Phase, mode: str) -> float | None:
    """The slowest rank's median time in `phase`: train mode's forward_s / backward_s; in
    forward mode the whole iteration is the forward (median_s) and there is no backward."""
    if mode != "train":
        return max((r.median_s for r in ranks), default=None) if phase == "forward" else None
    times = [r.forward_s if phase == "forward" else r.backward_s for r in ranks]
    if not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def kept_tflops_per_s(
    ranks: Sequence[RankResult], head_dim: int, batch_rows: int, mode: str
) -> tuple[float | None, float | None]:
    """(forward, backward) TFLOP/s from the kept pairs over the slowest rank's phase time."""
    forward = kept_flops(ranks, head_dim, batch_rows)
    if forward is None:
        return None, None
    out: list[float | None] = []
    for phase, flops in (("forward", forward), ("backward", BACKWARD_FLOP_FACTOR * forward)):
        seconds = phase_time(ranks, phase, mode)  # type: ignore[arg-type]
        out.append(flops / seconds / 1e12 if seconds else None)
    return out[0], out[1]


def ideal_fraction(
    time_s: float | None, world_size: int, single_time_s: float | None
) -> float | None:
    """(T_1 / W) / T_W: the share of the ideal a run of W ranks reaches (1.0: W ranks take a
    W-th of one process' time); None without either time."""
    if not time_s or not single_time_s or world_size < 1:
        return None
    return single_time_s / world_size / time_s


def documents_mask(row: RunRow) -> bool:
    """Whether the run's attention is under a documents mask (`params.mask.kind: documents`,
    or the older spelling `params.document_lengths`): the runs report.md's "Packed documents"
    section and the sweep page's chart of it show."""
    mask = row.params.get("mask")
    if isinstance(mask, dict) and mask.get("kind") == "documents":
        return True
    return row.params.get("document_lengths") is not None


def timed(row: RunRow) -> bool:
    """A succeeded run with a time (not a max_seq_len search)."""
    return row.status == "succeeded" and not row.searched and row.median_s is not None
