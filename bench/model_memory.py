"""Model memory, predicted vs measured: per component at one length, and the maximum length.

For every cell (model size x precision fp32 / bf16_autocast x checkpointing none / blocks) of
the `workload: model` decoder (dense attention, AdamW, batch 1):

1. one benchmark run at a fixed length (--seq; default 1024 on CPU, 4096 on CUDA): every
   memory component workers.model_memory.predict() names, predicted, measured (what
   workers.training measures phase by phase: CPU allocator (c10) bytes above the baseline, CUDA
   allocated bytes) and measured/predicted;
2. a maximum-length search (workers.search.run_search) under a memory budget (per size, or
   --budget-mib; emulated on CPU: a peak over it is an OOM, CUDA: the allocator is capped):
   the predicted maximum (model_memory.max_seq_len), the one the search finds (it starts from
   the prediction, brackets it by x1.125 steps, then narrows the bracket to predicted/32), the
   probes, each with its measured peak against the budget and against its own predicted step peak.

A summary table last, PASS/FAIL per target: parameters, gradients and optimizer states within
2% of the prediction, activations within 15%, the found maximum length within 10% of the
predicted one. The exit status is 1 when any target fails (usable as a check).

CPU (default): three tiny models (d_model 128/192/256, 2/3/4 layers, 4 heads, vocab 8192; 5.5,
11 and 20 MiB of fp32 parameters), 12 cells, a few minutes on 2 cores. The CPU meter counts
what c10's CPU allocator hands out (workers.memory.PeakMeter), as max_memory_allocated does on
CUDA: the math libraries' own buffers (oneDNN's primitive cache and reorders under bf16
autocast, MKL's fast memory manager), which are not the allocator's, are not in it. With the
resident-set meter it replaced they were (12-20 MiB), and the tiny cells read parameters,
gradients and states at 0.998-1.012 of the prediction and found 0.951 of the predicted maximum
length; now 1.000 and 1.000 (--quick, one thread).

CUDA (--device cuda): the 125M model (d_model 768, 12 heads, 12 layers, vocab 50304) on one
GPU, a 16 GiB budget.

    .venv/bin/python -m bench.model_memory [--device cpu] [--sizes tiny small medium] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from workers import model_memory
from workers.config import RunConfig
from workers.protocol import run_case
from workers.results import CaseOutcome, ProbeResult
from workers.search import run_search

MIB = 2**20
PRECISIONS = ("fp32", "bf16_autocast")
CHECKPOINTING = ("none", "blocks")
TARGETS: dict[str, float] = {
    "parameters": 0.02,
    "gradients": 0.02,
    "optimizer_states": 0.02,
    "activations": 0.15,
    "max_seq_len": 0.10,
}
"""Largest |measured / predicted - 1| that passes, per checked quantity."""
SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_states": "optim",
    "activations": "activ",
    "max_seq_len": "max len",
}
SEARCH_RESOLUTION = 32
"""The search narrows its bracket down to predicted max / this (~3%, well inside the 10% target)."""


@dataclass(frozen=True)
class Size:
    """One model shape and the memory budget its maximum-length search runs under."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int
    budget_mib: int

    def model(self) -> dict[str, object]:
        """The ModelConfig fields of this size."""
        return {
            "name": self.name,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "vocab_size": self.vocab_size,
        }

    def describe(self) -> str:
        """d_model, layers, heads, vocab in words."""
        return (
            f"d_model {self.d_model}, {self.n_layers} layers, {self.n_heads} heads, "
            f"vocab {self.vocab_size}"
        )


SIZES = {
    s.name: s
    for s in (
        Size("tiny", 128, 2, 4, 8192, 320),
        Size("small", 192, 3, 4, 8192, 384),
        Size("medium", 256, 4, 4, 8192, 512),
        Size("125M", 768, 12, 12, 50304, 16384),
    )
}
DEFAULT_SIZES = {"cpu": ["tiny", "small", "medium"], "cuda": ["125M"]}
DEFAULT_SEQ = {"cpu": 1024, "cuda": 4096}


def parse() -> argparse.Namespace:
    """The command line, with the device's default sizes and length filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=list(DEFAULT_SIZES))
    sizes = ", ".join(f"{' '.join(names)} on {dev}" for dev, names in DEFAULT_SIZES.items())
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help=f"default: {sizes}")
    seqs = ", ".join(f"{dev} {seq}" for dev, seq in DEFAULT_SEQ.items())
    ap.add_argument("--seq", type=int, help=f"benchmark length ({seqs})")
    budgets = ", ".join(f"{size.name} {size.budget_mib}" for size in SIZES.values())
    own = f"each size's own: {budgets}"
    ap.add_argument("--budget-mib", type=int, help=f"search budget for every size (default: {own})")
    ap.add_argument("--kernel", default="dense", help="the decoder's attention kernel")
    ap.add_argument("--warmup", type=int, default=1, help="benchmark run (probes: 0)")
    ap.add_argument("--iterations", type=int, default=1, help="benchmark run (probes: 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: the first size only (unless --sizes), warmup 0, 1 iteration",
    )
    args = ap.parse_args()
    if args.sizes is None:
        args.sizes = DEFAULT_SIZES[args.device][:1] if args.quick else DEFAULT_SIZES[args.device]
    if args.seq is None:
        args.seq = DEFAULT_SEQ[args.device]
    if args.quick:
        args.warmup, args.iterations = 0, 1
    return args


@dataclass
class Cell:
    """One size x precision x checkpointing: what was predicted, measured and found."""

    size: Size
    precision: str
    checkpointing: str
    ratios: dict[str, float | None] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        """size precision ckpt=checkpointing."""
        return f"{self.size.name} {self.precision} ckpt={self.checkpointing}"

    def passed(self, target: str) -> bool:
        """Whether the ratio for `target` exists and lies within its tolerance."""
        ratio = self.ratios.get(target)
        return ratio is not None and abs(ratio - 1.0) <= TARGETS[target]


def cell_config(cell: Cell, args: argparse.Namespace) -> RunConfig:
    """The benchmark run of a cell at --seq."""
    return RunConfig.model_validate(
        {
            "workload": "model",
            "kernel": args.kernel,
            "seq_len": args.seq,
            "device": args.device,
            "warmup": args.warmup,
            "iterations": args.iterations,
            "model": cell.size.model(),
            "training": {"precision": cell.precision, "checkpointing": cell.checkpointing},
        }
    )


def search_config(config: RunConfig, budget: int, predicted: int | None) -> RunConfig:
    """The cell under `budget` bytes with a search narrowing to predicted/32; probes take one
    step beyond the two measured ones (warmup 0, 1 iteration)."""
    granularity = max(16, (predicted or config.seq_len) // SEARCH_RESOLUTION)
    data = config.model_dump()
    data.update(
        memory_budget_bytes=budget,
        warmup=0,
        iterations=1,
        search={"start": predicted or config.seq_len, "granularity": granularity},
    )
    return RunConfig.model_validate(data)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.3f}"


def _ratio(measured: int | None, predicted: int | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def _verdict(ratio: float | None, target: str) -> str:
    tol = TARGETS[target]
    if ratio is None:
        return "FAIL"
    return "ok" if abs(ratio - 1.0) <= tol else "FAIL"


def print_components(cell: Cell, outcome: CaseOutcome) -> None:
    """The per-component table of the benchmark run; fills cell.ratios for the targets."""
    result = outcome.result
    if outcome.status != "ok" or result is None:
        cell.errors.append(f"benchmark run {outcome.status}: {outcome.error}")
        print(f"  benchmark run: {outcome.status}: {outcome.error}")
        return
    print(
        f"  benchmark at seq_len {result.seq_len}: forward {result.forward_s:.3f} s, backward "
        f"{result.backward_s:.3f} s, optimizer {result.optimizer_s:.3f} s (median)"
    )
    head = f"  {'component':<25}{'predicted MiB':>14}{'measured MiB':>14}{'meas/pred':>11}  target"
    print(head)
    print("  " + "-" * (len(head) - 2))
    for comp in result.components:
        ratio = _ratio(comp.measured_bytes, comp.predicted_bytes)
        if comp.component in TARGETS:
            cell.ratios[comp.component] = ratio
            tol = f"±{TARGETS[comp.component]:.0%} {_verdict(ratio, comp.component)}"
        elif comp.component == "optimizer_state_tensors":
            tol = "(bytes in optimizer.state)"
        else:
            tol = ""
        shown = "-" if ratio is None else f"{ratio:.4f}"
        line = (
            f"  {comp.component:<25}{_mib(comp.predicted_bytes):>14}"
            f"{_mib(comp.measured_bytes):>14}{shown:>11}  {tol}"
        )
        print(line.rstrip())


def _probe(p: ProbeResult, config: RunConfig, budget: int) -> str:
    """`length outcome peak/budget peak/predicted step peak` of one probe."""
    peak = p.peak_memory_bytes if p.peak_memory_bytes is not None else p.requested_bytes
    if peak is None:
        return f"{p.seq_len} {p.outcome}"
    predicted = model_memory.predict(config, p.seq_len).step_peak
    skipped = " (not run)" if p.emulated and p.peak_memory_bytes is None else ""
    return f"{p.seq_len} {p.outcome} {peak / budget:.3f}/{peak / predicted:.3f}{skipped}"


def print_search(cell: Cell, config: RunConfig, budget: int) -> None:
    """The maximum-length search under `budget`; fills cell.ratios['max_seq_len']."""
    predicted = model_memory.max_seq_len(config, budget)
    cfg = search_config(config, budget, predicted)
    outcome = run_search(cfg, lambda at, first: [run_case(at)])
    found = outcome.answer_seq_len if outcome.status == "succeeded" else None
    ratio = None if found is None or not predicted else found / predicted
    cell.ratios["max_seq_len"] = ratio
    if found is None:
        cell.errors.append(f"search {outcome.status}: {outcome.error}")
    shown = "-" if ratio is None else f"{ratio:.4f}"
    assert cfg.search is not None
    print(
        f"  search under {budget / MIB:g} MiB (to within {cfg.search.granularity}): "
        f"predicted max {predicted}, found {found if found is not None else outcome.status}, "
        f"{len(outcome.probes)} probes, found/predicted {shown} "
        f"(±{TARGETS['max_seq_len']:.0%} {_verdict(ratio, 'max_seq_len')})"
    )
    print(
        "    probes (length outcome peak/budget peak/predicted): "
        + ", ".join(_probe(p, config, budget) for p in outcome.probes)
    )


def run_cell(cell: Cell, args: argparse.Namespace) -> None:
    """Benchmark run and search of one cell, printed as they end."""
    t0 = time.monotonic()
    config = cell_config(cell, args)
    budget = (args.budget_mib or cell.size.budget_mib) * MIB
    print(
        f"== {cell.size.name} ({cell.size.describe()}) {cell.precision}, checkpointing "
        f"{cell.checkpointing}",
        flush=True,
    )
    print_components(cell, run_case(config))
    print_search(cell, config, budget)
    cell.seconds = time.monotonic() - t0
    print(f"  ({cell.seconds:.1f} s)", flush=True)


def summary(cells: list[Cell]) -> bool:
    """The PASS/FAIL table: a row per cell (measured/predicted per target), a line per target;
    returns whether everything passed."""
    targets = list(TARGETS)
    head = f"{'cell':<36}" + "".join(f"{SHORT[t]:>14}" for t in targets)
    print()
    print("summary: measured/predicted (found/predicted for max len)")
    print(head)
    print("-" * len(head))
    for cell in cells:
        parts = []
        for t in targets:
            ratio = cell.ratios.get(t)
            value = "-" if ratio is None else f"{ratio:.3f}"
            parts.append(f"{value + ' ' + ('ok' if cell.passed(t) else 'FAIL'):>14}")
        print(f"{cell.label:<36}" + "".join(parts))
    print("-" * len(head))
    ok = True
    for t in targets:
        good = sum(cell.passed(t) for cell in cells)
        seen = [r for c in cells if (r := c.ratios.get(t)) is not None]
        worst = max(seen, key=lambda r: abs(r - 1.0)) if seen else None
        verdict = "PASS" if good == len(cells) else "FAIL"
        ok = ok and verdict == "PASS"
        worst_text = "-" if worst is None else f"{worst:.4f}"
        print(
            f"{SHORT[t] + ' within ' + format(TARGETS[t], '.0%'):<24}{verdict:<6}"
            f"{good}/{len(cells)} cells, worst ratio {worst_text}"
        )
    for cell in cells:
        for error in cell.errors:
            print(f"{cell.label}: {error}")
    return ok and not any(cell.errors)


def main() -> None:
    args = parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"setup: torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads "
        f"(os.cpu_count()={os.cpu_count()}, load average {os.getloadavg()[0]:.2f}); kernel "
        f"{args.kernel}, AdamW, batch 1; benchmark at seq_len {args.seq} (warmup "
        f"{args.warmup}, iterations {args.iterations}); search probes: warmup 0, iterations 1"
    )
    for name in args.sizes:
        size = SIZES[name]
        budget = args.budget_mib or size.budget_mib
        print(f"       {name}: {size.describe()}; search budget {budget} MiB")
    print(
        "       measured: "
        + (
            "bytes the CPU allocator (c10) held above the baseline (workers.memory.PeakMeter)"
            if args.device == "cpu"
            else "torch.cuda memory_allocated / max_memory_allocated"
        )
    )
    cells = [
        Cell(SIZES[name], precision, ckpt)
        for name in args.sizes
        for precision in PRECISIONS
        for ckpt in CHECKPOINTING
    ]
    for cell in cells:
        run_cell(cell, args)
    ok = summary(cells)
    print(f"(bench took {time.monotonic() - t0:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
