"""The device check's protocol step (scripts/device_check.sh): workers.protocol.run_case, no Ray.

    python scripts/device_protocol.py --device cuda --seq 16384 --dtype bfloat16

Runs, in this process, what a rank actor runs inside the engine:
- dense, dilated and block_sparse in train mode with the correctness gate on (bench.gpu's params
  at that length, h=16 d=128 on a GPU);
- ring, ring_dilated and ring_block_sparse the same way at W = 1, in a one-rank process group
  (NCCL on a GPU, gloo on CPU: bench.gpu.one_rank_group);
- a deliberate OOM: dense inputs far over a memory budget, which must come back `oom` with the
  bytes asked for and, on a GPU, the rank's memory snapshot as an artifact (on CPU the budget is
  emulated by the peak meter: `oom`, flagged emulated, and no snapshot).
One JSON line per case, then a table; exit 1 when any case is not what it must be.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from bench.gpu import RING, SINGLE, one_rank_group, scaled
from workers import protocol
from workers.config import RunConfig
from workers.results import CaseOutcome

SHAPE = {"cuda": {"num_heads": 16, "head_dim": 128}, "cpu": {"num_heads": 2, "head_dim": 16}}
OOM = {
    "cuda": {"seq_len": 1 << 20, "num_heads": 8, "head_dim": 64, "budget": 256 * 2**20},
    "cpu": {"seq_len": 1 << 14, "num_heads": 2, "head_dim": 16, "budget": 4 * 2**20},
}
"""The deliberate OOM: dense inputs of 2 GiB each (GPU) or 2 MiB (CPU) under a 256 MiB or
4 MiB budget."""


def _or_dash(value: object) -> str:
    """A figure as printed, or - when it was not measured (an exact 0.0 is a figure)."""
    return "-" if value is None else str(value)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--seq", type=int, required=True, help="the gated cases' length")
    ap.add_argument("--dtype", required=True, help="the gated cases' dtype")
    return ap.parse_args(argv)


def gated_config(kernel: str, args: argparse.Namespace) -> RunConfig:
    """One train case of `kernel` at --seq, correctness gate on."""
    return RunConfig(
        kernel=kernel, params=scaled(kernel, args.seq), seq_len=args.seq, dtype=args.dtype,
        mode="train", device=args.device, correctness_check=True, warmup=1, iterations=3,
        **SHAPE[args.device],
    )  # fmt: skip


def oom_config(device: str) -> RunConfig:
    """The deliberate OOM under its budget (OOM), ungated: it measures the OOM, not the kernel
    (the gate, which no budget caps, would first run the whole dense attention at its length:
    2^20 tokens in fp32 on a GPU, tens of seconds and 14 GiB)."""
    o = OOM[device]
    return RunConfig(
        kernel="dense", seq_len=o["seq_len"], num_heads=o["num_heads"], head_dim=o["head_dim"],
        device=device, memory_budget_bytes=o["budget"], warmup=0, iterations=1,
        correctness_check=False,
    )  # fmt: skip


def cases(args: argparse.Namespace) -> list[tuple[str, RunConfig]]:
    """Every case of the step, in order (scripts/device_plan.py budgets the same list): the
    single-process kernels, the ring kernels at W = 1, the deliberate OOM."""
    gated = [(k, gated_config(k, args)) for k in (*SINGLE, *RING)]
    return [*gated, ("deliberate oom", oom_config(args.device))]


def gated_problem(case: CaseOutcome) -> str | None:
    """What a gated case lacks: status ok and the gate's full check's error (the gate ran)."""
    if case.status != "ok" or case.result is None:
        return f"came back {case.status}: {case.error}"
    if case.result.max_abs_error is None:
        return "the correctness gate did not run"
    return None


def oom_problem(case: CaseOutcome, device: str) -> str | None:
    """What the deliberate OOM lacks: status oom, the bytes asked for (a real OOM), the memory
    snapshot artifact (GPU)."""
    if case.status != "oom":
        return f"came back {case.status}: {case.error}"
    if device == "cuda":
        kinds = [a.kind for a in case.artifacts]
        if case.emulated or not case.requested_bytes or "memory_snapshot" not in kinds:
            return f"emulated {case.emulated}, asked {case.requested_bytes}, artifacts {kinds}"
    return None


def line(name: str, case: CaseOutcome, seconds: float, problem: str | None) -> dict[str, Any]:
    """The case's JSON line: what it measured, the gate's verdict, what is wrong with it."""
    result = case.result
    return {
        "case": name, "status": case.status, "ok": problem is None, "problem": problem,
        "wall_s": round(seconds, 2), "seq_len": case.seq_len, "emulated": case.emulated,
        "requested_bytes": case.requested_bytes, "artifacts": [a.name for a in case.artifacts],
        "backend": result and result.backend, "median_s": result and result.median_s,
        "peak_memory_bytes": result and result.peak_memory_bytes,
        "max_abs_error": result and result.max_abs_error,
        "sampled_check_error": result and result.sampled_check_error, "error": case.error,
    }  # fmt: skip


def main() -> int:
    args = parse()
    lines = []
    with one_rank_group(torch.device(args.device)):  # the ring kernels' W = 1
        for name, config in cases(args):
            start = time.monotonic()
            case = protocol.run_case(config)
            oom = name == "deliberate oom"
            problem = oom_problem(case, args.device) if oom else gated_problem(case)
            lines.append(line(name, case, time.monotonic() - start, problem))
            print(json.dumps(lines[-1], default=str), flush=True)
    print("\n| case | status | ok | wall s | median ms | peak MiB | gate error |")
    print("|---|---|---|---|---|---|---|")
    for r in lines:
        peak = r["peak_memory_bytes"] and f"{r['peak_memory_bytes'] / 2**20:.1f}"
        ms = r["median_s"] and f"{r['median_s'] * 1e3:.2f}"
        print(f"| {r['case']} | {r['status']} | {'yes' if r['ok'] else 'NO'} | {r['wall_s']} | "
              f"{ms or '-'} | {peak or '-'} | {_or_dash(r['max_abs_error'])} |")  # fmt: skip
    return 0 if all(r["ok"] for r in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
