"""The one read model of results: a typed row per run, built from the run, its rank results and
its probes. results.json, results.csv, report.md, the dashboard and the compare page all read
these rows, so every number has exactly one definition, here:

- measured length: the length the ranks measured (``RankResult.seq_len``): the cell's length for
  a benchmark, the search's answer for a max_seq_len run;
- time: the slowest rank's median per iteration (a ring step ends when its last rank does), with
  that rank's p10-p90 as the spread, and that rank's 95% confidence interval of the median
  (order statistics, workers.noise.median_interval; from 6 iterations on; with 2-5 the range of
  all its samples at the lower level median_ci_level says; none with 1) as the noise every
  ratio carries (service.results.baselines);
- iterations: the timed iterations the run ran (the length of its ranks' times_s);
- tokens/s: batch_size x measured length / time;
- FLOP/s: the FLOPs of every rank summed, over the time; per rank: that sum / world size;
- peak memory: each rank's own peak (reset for the case); the headline is the largest;
- memory floor (attention cells): q, k, v, out in the input dtype plus the fp32 lse, for the tokens
  one rank holds;
- memory per token: the largest rank peak over the tokens that rank holds;
- maximum length: the longest probe that fit;
- flags: a result above the physical limit (Flag), never shown without its mark: here a rank's
  peak below the inputs it held (peak_below_inputs); service.results.baselines adds the
  ratios' flags.

A ring run adds, from its ranks' steps (attention.ring.steps; table ring_step, and each rank's
totals in rank_result):
- exposed-communication share: the time every rank spent blocked on a transfer over its time in
  steps (compute + wait), summed over ranks and timed iterations;
- step coverage: the smallest share of a rank's iteration time its steps account for;
- crossover (`ring` only): the tokens per rank at which a step's compute would hide its
  transfer (F/B), from the rate the steps computed at (their FLOPs over their compute time)
  and the run's probed link.

Every sequence-parallel run over W > 1 ranks (any ring kernel, ours or a plugin's) measures its
ring links before its timed loop (workers.link: each rank pings one K/V block to its next
neighbour and back, alone, nothing else running); each rank stores its link's figures:
- link: the slowest rank's link bandwidth (a ring step ends when its slowest hop does), and the
  largest latency;
- link kind: what the link was: "loopback (one host)" for CPU ranks on one host (gloo over
  loopback TCP), "one host (GPU to GPU)" for GPU ranks on one host, "network (N hosts)" when
  the ranks spanned N hosts (the environment's hosts); it goes wherever the figure goes.
A step's transfer window (posting to completion, stored per step and each rank's best) is not a
link figure: it includes waiting for the peer to post its side.

Each rank's share of the work (service.results.work_share, which says how each is computed):
the kept-pairs imbalance, the measured compute imbalance, TFLOP/s from the kept pairs (forward
and backward apart) and, for W > 1, % of ideal against the same cell's single-process run.

A model cell (`workload: model`) adds, from its limiting rank (the largest measured step peak):
its memory components predicted and measured (StoredComponent, ratio = measured / predicted);
fixed memory = parameters + gradients + optimizer states (measured); memory per token = (step
peak - fixed) / the tokens the rank holds; the predicted maximum length; the step's forward,
backward and optimizer times of the slowest rank; MFU = per-rank FLOP/s (6 x parameters per
token plus the kernel's attention FLOPs) over the device's dense peak (peak_fraction).

Raw units only (bytes, seconds, FLOP/s); formatting is the caller's. The rows are built from
the stored columns in service.results.rows_build.
"""

from __future__ import annotations

import json
from copy import deepcopy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from service.results.stored import StoredComponent, StoredProbe, StoredRank
from workers.noise import Interval, inverse
from workers.results import stored_fields

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}

NOT_MEASURED_FIELDS = frozenset(
    {
        "name", "tags", "label", "timeout_s", "dist_timeout_s", "max_attempts", "iterations",
        "time_cap_s",
    }
)  # fmt: skip
"""Fields that name or bound a run without changing what it measures: two sweeps' cells match
(compare page) when their configs are equal once these are dropped. The iteration count and
time cap decide how many samples, not what is sampled (each run's interval says how sure its
median is): a cell rerun under `iterations: auto` matches its predecessor at 5."""


def config_key(config: dict[str, Any]) -> str:
    """The canonical JSON of a config without NOT_MEASURED_FIELDS: the compare page's cell key."""
    kept = {k: v for k, v in config.items() if k not in NOT_MEASURED_FIELDS}
    # a param set to None is the kernel's default, as if unset (see baselines._match_key)
    kept["params"] = {k: v for k, v in (kept.get("params") or {}).items() if v is not None}
    if not kept.get("profile"):  # unprofiled: what a cell stored before `profile` existed is
        kept.pop("profile", None)
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def median_interval(lo: float | None, hi: float | None, level: float | None) -> Interval | None:
    """A median time's interval from its stored bounds and level (None without one: one
    iteration, or nothing measured)."""
    if lo is None or hi is None or level is None:
        return None
    return Interval(lo, hi, level)


def local_tokens(parallel: str, world_size: int, batch_size: int, seq_len: int) -> int:
    """Tokens one rank holds: its share of the batch (data) or of the sequence (sequence)."""
    w = max(world_size, 1)
    if parallel == "data":
        return max(batch_size // w, 1) * seq_len
    return batch_size * max(seq_len // w, 1)


def memory_floor(
    dtype: str, num_heads: int, head_dim: int, tokens: int, num_kv_heads: int | None = None
) -> int | None:
    """Forward floor for `tokens` on one rank: q and out (2*h*d*bytes), k and v with their own
    heads (2*h_kv*d*bytes; h_kv = h without grouped-query attention) + fp32 lse (4*h)."""
    bpe = BYTES_PER_ELEMENT.get(dtype)
    if bpe is None:
        return None
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return (2 * (num_heads + kv) * head_dim * bpe + 4 * num_heads) * tokens


RANK_FIELDS = set(stored_fields(StoredRank))
"""What a rank of a row holds: the stored fields of workers.results.RankResult and its node."""


@dataclass(frozen=True)
class Flag:
    """A number above its physical limit: `code` (short, stable), the row `field` it marks,
    and a sentence that says what is wrong with it."""

    code: str
    field: str
    text: str


def _doc(text: str, export: bool = True) -> dict[str, Any]:
    """A RunRow field's metadata: what it means (results.json's schema says it) and whether
    results.json and results.csv carry it (service.results.export.EXPORTED)."""
    return {"doc": text, "export": export}


def _optional(text: str, export: bool = True) -> Any:
    """A RunRow field that is None unless measured, with its metadata (_doc)."""
    return field(default=None, metadata=_doc(text, export))


@dataclass(kw_only=True, slots=True)
class RunRow:
    """One run with every number a table or chart shows for it (see the module docstring).

    The declaration of results.json and results.csv: their columns are its fields marked for
    export, in this order, each described by its doc (service.results.export)."""

    run_id: int
    sweep_id: int
    label: str = field(default="", metadata=_doc("The kernel and what varies within the sweep."))
    kernel: str
    params: dict[str, Any] = field(metadata=_doc("The kernel's parameters as canonical JSON."))
    seq_len: int = field(metadata=_doc("The cell's length (a max_seq_len search's start)."))
    measured_seq_len: int | None = _optional(
        "The length the ranks measured: seq_len, or a search's answer."
    )
    world_size: int
    batch_size: int
    num_heads: int
    num_kv_heads: int = field(metadata=_doc("Key/value heads (num_heads without grouped-query)."))
    head_dim: int
    dtype: str
    causal: bool
    mode: str
    parallel: str
    status: str
    outcome: str = field(
        default="", metadata=_doc("ok (with the correctness error and its length), OOM, ...")
    )
    attempts: int
    median_s: float | None = _optional("Slowest rank's median seconds per iteration.")
    p10_s: float | None = _optional("That rank's 10th percentile.")
    p90_s: float | None = _optional("That rank's 90th percentile.")
    median_lo_s: float | None = _optional(
        "That rank's confidence interval of the median, low end (order statistics; None with "
        "one iteration)."
    )
    median_hi_s: float | None = _optional("Its high end.")
    median_ci_level: float | None = _optional(
        "Its coverage: >= 0.95 from 6 iterations, below with 2-5 (their range)."
    )
    iterations: int | None = _optional("Timed iterations run (length of times_s).")
    tokens_per_s: float | None = _optional("batch_size * measured_seq_len / median_s.")
    tflops_per_s: float | None = _optional("FLOPs summed over ranks / median_s / 1e12.")
    flops_per_s_per_rank: float | None = _optional("FLOPs summed / median_s / ranks.")
    peak_fraction: float | None = _optional("Per-rank FLOP/s / the GPU's dense peak.")
    matmul_fraction: float | None = _optional(
        "Per-rank FLOP/s / the node's measured matmul rate (its environment's GEMM probe, "
        "on CPU as on GPU); None where the probe was not stored."
    )
    peak_memory_bytes: int | None = _optional("Largest per-rank peak memory.")
    rank_peak_bytes: list[int] = field(
        default_factory=list, metadata=_doc("Each rank's peak memory, in rank order.")
    )
    input_memory_bytes: int | None = _optional("Largest memory after the inputs.")
    resident_peak_bytes: int | None = _optional(
        "CPU: the largest per-rank resident-set (RSS) high-water mark above the baseline, a "
        "second figure beside the allocator's peak_memory_bytes."
    )
    floor_bytes: int | None = _optional("q, k, v, out and lse for one rank's tokens.")
    memory_per_token_bytes: float | None = _optional("Peak / tokens one rank holds.")
    max_seq_len: int | None = _optional("max_seq_len runs: the longest length that fit.")
    exposed_comm_share: float | None = _optional(
        "Sequence-parallel kernels: time blocked on transfers / time in steps, all ranks."
    )
    step_coverage: float | None = _optional(
        "Sequence-parallel kernels: the smallest share of a rank's time its steps account for."
    )
    comm_bytes_per_rank: float | None = _optional(
        "Sequence parallel: bytes moved per rank per timed iteration (the most any rank "
        "received: K/V hops, all-to-alls, gathers and reduce-scatters)."
    )
    ulysses_groups: str | None = _optional(
        "usp: each Ulysses group's ranks and the node(s) they ran on ('ranks 0-1 on 10.0.0.1;"
        " ...'); a group across nodes says so."
    )
    step_flops_per_s_per_rank: float | None = _optional(
        "Sequence parallel: one rank's compute rate in its steps (FLOPs over the steps' "
        "compute seconds, all ranks summed)."
    )
    link_probe_bytes_per_s: float | None = _optional(
        "W > 1 sequence parallel: the ring link's bandwidth, probed before the timed loop "
        "(one K/V block pinged to the next rank and back); the slowest rank's."
    )
    link_latency_s: float | None = _optional(
        "The probed links' largest one-way time of a 4-byte message."
    )
    link_kind: str | None = _optional(
        "What the probed link was: loopback (one host), one host (GPU to GPU), network (N hosts)."
    )
    crossover_tokens: float | None = _optional(
        "ring: tokens per rank where compute would hide a step's transfer (F/B)."
    )
    crossover_basis: str | None = _optional(
        "Where F and B come from: the steps' compute rate and the probed link (with its kind)."
    )
    backend: str | None = _optional("The backends the ranks ran, comma-separated.")
    plan: str | None = _optional(
        "The execution plans the ranks ran (cpu, cuda), comma-separated: what `plan: auto` "
        "became on the device; None for kernels without a plan and runs stored before."
    )
    max_abs_error: float | None = _optional(
        "The correctness gate's full check (every row); None: not checked."
    )
    check_seq_len: int | None = _optional("The length the full check ran at.")
    sampled_check_error: float | None = _optional(
        "The gate's sampled rows at the run's own length (None: the full check ran at the "
        "run's length)."
    )
    sampled_check_seq_len: int | None = _optional("The sampled check's length.")
    sampled_check_rows: int | None = _optional("Rows the sampled check compared.")
    baseline_run_id: int | None = _optional("The run the ratios compare with.")
    baseline: str | None = _optional("What the baseline changes (e.g. W=1, dense).")
    speedup: float | None = _optional("tokens_per_s / the baseline's.")
    memory_ratio: float | None = _optional("peak_memory_bytes / the baseline's.")
    max_len_gain: float | None = _optional("max_seq_len / the baseline's.")
    efficiency: float | None = _optional("Gain / world-size ratio (W differs only).")
    speedup_lo: float | None = _optional(
        "The speedup's interval from both runs' median intervals: a_lo / b_hi."
    )
    speedup_hi: float | None = _optional("a_hi / b_lo.")
    efficiency_lo: float | None = _optional("speedup_lo / world-size ratio (timed).")
    efficiency_hi: float | None = _optional("speedup_hi / world-size ratio (timed).")
    within_noise: list[str] = field(
        default_factory=list,
        metadata=_doc("The ratios whose interval holds 1.0 (speedup, checkpoint_time_ratio)."),
    )
    flags: list[Flag] = field(
        default_factory=list, metadata=_doc("Numbers of this row above a physical limit.")
    )
    workload: str = field(
        default="attention", metadata=_doc("attention (the kernel alone) or model (training).")
    )
    model: str | None = _optional("Model cells: the model's name, else its shape.")
    model_shape: str | None = _optional("Model cells: d_model x heads x layers.")
    optimizer: str | None = field(default=None)
    precision: str | None = field(default=None)
    checkpointing: str | None = field(default=None)
    fixed_bytes: int | None = _optional("Parameters + gradients + optimizer states.")
    predicted_fixed_bytes: int | None = field(default=None)
    bytes_per_token: float | None = _optional("(Step peak - fixed) / rank tokens.")
    predicted_peak_bytes: int | None = _optional("The predicted step peak.")
    predicted_max_seq_len: int | None = _optional(
        "The longest length predicted to fit the memory budget."
    )
    forward_s: float | None = _optional(
        "Train mode: the slowest rank's median forward seconds (timed apart within each iteration)."
    )
    backward_s: float | None = _optional("Train mode: that rank's median backward seconds.")
    forward_p10_s: float | None = _optional(
        "Kernel cells in train mode: its forward's 10th percentile."
    )
    forward_p90_s: float | None = _optional("Its forward's 90th percentile.")
    backward_p10_s: float | None = _optional("Its backward's 10th percentile.")
    backward_p90_s: float | None = _optional("Its backward's 90th percentile.")
    forward_tflops_per_s: float | None = field(
        default=None,
        metadata=_doc(
            "Kernel cells in train mode: the kernel's own forward FLOPs (flops(backward=False)) "
            "summed over ranks / forward_s / 1e12 (tflops_per_s is forward + backward's)."
        ),
    )
    backward_tflops_per_s: float | None = _optional(
        "Its backward FLOPs (forward + backward minus forward) summed over ranks / "
        "backward_s / 1e12."
    )
    optimizer_s: float | None = _optional("Model cells: median optimizer seconds.")
    wasted_comm_share: float | None = _optional(
        "The ranks' wasted_comm_bytes / their comm_bytes (K/V received that kept no pair); "
        "None for kernels that do not count them."
    )
    kept_pairs_imbalance: float | None = _optional(
        "Max / mean over the ranks of kept_pairs (the query-key pairs each rank computes "
        "under the run's mask and balance); None where a rank does not count them "
        "(service.results.work_share)."
    )
    compute_imbalance: float | None = _optional(
        "Max / mean over the ranks of their measured compute seconds (the step clock's "
        "step_compute_s); None for kernels without a step clock."
    )
    kept_forward_tflops_per_s: float | None = _optional(
        "4 x head_dim x kept pairs summed over the ranks x batch rows / the slowest rank's "
        "forward seconds / 1e12."
    )
    kept_backward_tflops_per_s: float | None = _optional(
        "2.5 x those forward FLOPs / the slowest rank's backward seconds / 1e12."
    )
    ideal_run_id: int | None = _optional(
        "W > 1: the same cell's single-process run that ideal_fraction reads."
    )
    ideal_fraction: float | None = _optional(
        "% of ideal: (that run's median_s / world_size) / median_s; None without one."
    )
    checkpoint_time_ratio: float | None = _optional(
        "Step time / the same cell's without checkpointing."
    )
    checkpoint_time_ratio_lo: float | None = _optional("Its interval's low end.")
    checkpoint_time_ratio_hi: float | None = _optional("Its interval's high end.")
    scheme: str = field(
        default="",
        metadata=_doc(
            "The kernel and the params given beside its mask, declared defaults left out "
            "('allgather_kv · balance=ptrr · gather=needed'): what the schemes sections and "
            "charts name a run by."
        ),
    )
    components: list[StoredComponent] = field(
        default_factory=list, metadata=_doc("Model cells: the limiting rank's memory components.")
    )
    device: str | None
    environment_id: int | None
    error: str | None
    config: dict[str, Any] = field(metadata=_doc("", export=False))
    searched: bool = field(metadata=_doc("", export=False))
    ranks: list[StoredRank] = field(metadata=_doc("", export=False))
    probes: list[StoredProbe] = field(metadata=_doc("", export=False))
    flops_per_s: float | None = _optional("", export=False)
    series: str = field(default="", metadata=_doc("", export=False))
    cotenants: list[int] | None = field(
        default=None,
        metadata=_doc(
            "Runs whose gangs shared this run's nodes while it ran (None: never placed, or stored"
            " before they were recorded): its times may include contention.",
            export=False,
        ),
    )
    predicted_peaks: list[tuple[int, int]] = field(
        default_factory=list, metadata=_doc("", export=False)
    )

    def component(self, name: str) -> StoredComponent | None:
        """The limiting rank's component `name`, if stored."""
        return next((c for c in self.components if c.component == name), None)

    @property
    def time_interval(self) -> Interval | None:
        """The median time's interval (None without one: 1 iteration, or nothing measured)."""
        return median_interval(self.median_lo_s, self.median_hi_s, self.median_ci_level)

    @property
    def tokens_per_s_interval(self) -> Interval | None:
        """tokens/s from the time's interval: batch x measured length / [hi, lo]."""
        if self.measured_seq_len is None:
            return None
        return inverse(self.time_interval, self.batch_size * self.measured_seq_len)

    def flag(self, code: str, field: str) -> Flag | None:
        """This row's flag `code` on `field`, if raised."""
        return next((f for f in self.flags if f.code == code and f.field == field), None)

    def flags_on(self, field: str) -> list[Flag]:
        """The flags that mark `field` (a number never shown without them)."""
        return [f for f in self.flags if f.field == field]

    @property
    def length(self) -> int:
        """Where the run sits on a length axis: the measured length, else the cell's."""
        return self.measured_seq_len or self.seq_len

    @property
    def cell_key(self) -> str:
        return config_key(self.config)

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values (the dashboard's payload row): a rank as its
        stored fields and node, a component with its ratio."""
        out = {f.name: deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "config"}
        out["flags"] = [asdict(f) for f in self.flags]
        out["ranks"] = [r.model_dump(include=RANK_FIELDS) for r in self.ranks]
        out["probes"] = [p.model_dump() for p in self.probes]
        out["components"] = [c.model_dump() for c in self.components]
        out["length"] = self.length
        return out
