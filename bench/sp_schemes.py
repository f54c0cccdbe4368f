"""Sequence-parallel schemes side by side on CPU: ring (zigzag), ulysses, allgather_kv (zigzag)
and usp (U=2, zigzag), forward+backward, causal, at each world size of --worlds, gloo with one
thread per rank, the schemes alternating within each round so a noisy machine's drift falls on
all of them.

Per scheme and world size: the median over rounds of the slowest rank's median fwd+bwd time,
its spread (min-max over rounds), the ratio to the zigzag ring's time in the same round (median
of the rounds' ratios), the peak per rank (workers.memory.PeakMeter, inputs included, one
metered fwd+bwd), the exposed-communication share and the bytes each rank sent in one fwd+bwd
(the step clock, attention.ring.steps), and for ulysses, allgather_kv and usp their memory
model's peak (Kernel.memory_model, see predicted_peak) against the measured one; and the time
report.md's schemes section predicts (service.results.schemes.predicted_s) from the case's
own compute
rate in its steps, bytes received and probed link (workers.link), against the measured time.
Every scheme passes bench.ring's correctness gate first (a short sequence vs dense).

    .venv/bin/python -m bench.sp_schemes [--seq 16384] [--worlds 2,4] [--rounds 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

import attention
from attention import layouts
from attention.ring.steps import clock
from bench import ring as ringbench
from service.results.schemes import predicted_s
from workers.link import probe_ring_link
from workers.memory import PeakMeter

SCHEMES = {
    "ring": {"layout": "zigzag"},
    "ulysses": {},
    "allgather_kv": {"layout": "zigzag"},
    "usp": {"ulysses_degree": 2, "layout": "zigzag"},
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    return ap.parse_args()


def _layout(kernel: str, params: dict) -> str:
    return "contiguous" if kernel == "ulysses" else params["layout"]


def measure(args: dict, kernel: str, params: dict, layout: str | None, causal: bool) -> dict:
    """This rank's fwd+bwd times, metered peak, step-clock share and bytes (one fwd+bwd)."""
    device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = attention.build(kernel, **params)
    assert layout is not None
    ringbench.gate(args, module, attention.build("dense"), layout, causal)
    ringbench.warm_up(args, module, layout, causal)
    meter = PeakMeter(device)
    meter.baseline()
    full = ringbench._inputs(args, args["seq"], device, torch.float32, seed=0)
    q, k, v, dout = (layouts.shard(t, layout, rank, world) for t in full)
    del full
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd_bwd() -> None:
        module(q, k, v, causal=causal).backward(dout)
        q.grad = k.grad = v.grad = None

    meter.reset()
    fwd_bwd()
    peak = meter.peak()
    meter.stop()
    times = [ringbench._time_call(fwd_bwd, device) for _ in range(args["repeats"])]
    clock.start(device)
    fwd_bwd()
    steps = clock.collect()
    clock.stop()
    result = {"rank": rank, "fwd_bwd_s": times, "peak_bytes": peak}
    result["wait_s"] = sum(s["wait_s"] for s in steps)
    result["busy_s"] = sum(s["wait_s"] + s["compute_s"] for s in steps)
    result["sent_bytes"] = sum(s["sent_bytes"] for s in steps)
    result["received_bytes"] = sum(s["received_bytes"] for s in steps)
    result["flops"] = module.flops(*q.shape, causal=causal, backward=True)
    kv_block = 2 * k.numel() * k.element_size()  # what the service's probe pings (workers.link)
    result["link_bytes_per_s"] = probe_ring_link(kv_block, device).bytes_per_s
    if kernel in MODELLED:
        if hasattr(module, "causal"):  # allgather_kv: its blocks' key spans
            module.causal = causal
        result["predicted_peak"] = predicted_peak(module, q)
    return result


MODELLED = ("ulysses", "allgather_kv", "usp")
"""The schemes with a memory model (Kernel.memory_model)."""


def predicted_peak(module: Any, q: torch.Tensor) -> int:
    """The peak per rank its memory model predicts for this benchmark's fwd+bwd: q, k, v and
    dout held by the benchmark, what the call saves beyond them, the returned output when it
    is not saved, and the larger transient."""
    m = module.memory_model(q.shape[0], q.shape[1], q.shape[2], q.shape[3], q.element_size())
    one = q.numel() * q.element_size()
    saved = m.saved - (3 * one if m.inputs_saved else 0)
    output = 0 if m.output_saved else one
    return 4 * one + saved + output + max(m.forward_transient, m.backward_transient)


def run_case(a: argparse.Namespace, kernel: str, world: int) -> list[dict]:
    params = SCHEMES[kernel]
    args = {**vars(a), "device": "cpu", "device_name": "cpu"}
    job = {"kernel": kernel, "params": params, "layout": _layout(kernel, params)}
    job.update(causal=True, threads=1, distributed=True, measure=measure)
    return ringbench.run_job(args, job, world)


def _slowest(ranks: list[dict]) -> float:
    per_repeat = zip(*(r["fwd_bwd_s"] for r in ranks), strict=True)
    return statistics.median(max(t) for t in per_repeat)


def predicted(a: argparse.Namespace, kernel: str, world: int, ranks: list[dict]) -> float | None:
    """The time service.results.schemes.predicted_s predicts from this case's own figures, as the
    service computes them from a run's ranks: compute rate in the steps (FLOPs over compute
    seconds, ranks summed), bytes moved (the most any rank received), the slowest probed link."""
    row = {
        "kernel": kernel, "params": SCHEMES[kernel], "world_size": world, "batch_size": a.batch,
        "seq_len": a.seq, "num_heads": a.heads, "num_kv_heads": a.heads, "head_dim": a.dim,
        "dtype": "float32", "mode": "train", "median_s": _slowest(ranks),
        "flops_per_s_per_rank": sum(r["flops"] for r in ranks) / world / _slowest(ranks),
        "step_flops_per_s_per_rank": sum(r["flops"] for r in ranks)
        / sum(r["busy_s"] - r["wait_s"] for r in ranks),
        "comm_bytes_per_rank": max(r["received_bytes"] for r in ranks),
        "link_probe_bytes_per_s": min(r["link_bytes_per_s"] for r in ranks),
    }  # fmt: skip
    return predicted_s(row)


def report(
    a: argparse.Namespace, kernel: str, world: int, rounds: list[dict[str, list[dict]]]
) -> None:
    """One JSON line and one readable line for a scheme at one world size."""
    times = [_slowest(r[kernel]) for r in rounds]
    ratios = [_slowest(r[kernel]) / _slowest(r["ring"]) for r in rounds]
    last = rounds[-1][kernel]
    share = sum(r["wait_s"] for r in last) / sum(r["busy_s"] for r in last)
    line: dict[str, Any] = {
        "scheme": kernel,
        "world": world,
        "fwd_bwd_s": [round(t, 3) for t in times],
        "ratio_to_ring": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "peak_per_rank_mib": [round(r["peak_bytes"] / 2**20, 1) for r in last],
        "exposed_comm_share": round(share, 4),
        "sent_mib_per_rank": [round(r["sent_bytes"] / 2**20, 1) for r in last],
        "link_mb_per_s": round(min(r["link_bytes_per_s"] for r in last) / 1e6),
    }
    guess = predicted(a, kernel, world, last)
    if guess is not None:
        line["predicted_s"] = round(guess, 3)
        line["measured_over_predicted"] = round(_slowest(last) / guess, 3)
    if "predicted_peak" in last[0]:
        line["predicted_peak_mib"] = [round(r["predicted_peak"] / 2**20, 1) for r in last]
        line["peak_measured_over_predicted"] = [
            round(r["peak_bytes"] / r["predicted_peak"], 3) for r in last
        ]
    print(json.dumps(line), flush=True)
    print(
        f"  W={world} {kernel:13s} {statistics.median(times):7.3f} s (rounds "
        f"{min(times):.3f}-{max(times):.3f}), x{line['ratio_to_ring']:.3f} of ring, peak/rank "
        f"max {max(line['peak_per_rank_mib']):.1f} MiB, exposed comm {share:.1%}, sent/rank "
        f"{max(line['sent_mib_per_rank']):.1f} MiB",
        flush=True,
    )


def main() -> None:
    a = parse()
    schemes = a.schemes.split(",")
    print(
        f"setup: {', '.join(schemes)}; total seq {a.seq}, batch {a.batch}, heads {a.heads}, "
        f"head_dim {a.dim}, fp32 cpu, causal, fwd+bwd; gloo, 1 thread per rank; {a.repeats} "
        f"repeats after a warm-up, {a.rounds} rounds alternating the schemes; torch "
        f"{torch.__version__}; os.cpu_count()={os.cpu_count()}",
        flush=True,
    )
    for world in (int(w) for w in a.worlds.split(",")):
        rounds = [{k: run_case(a, k, world) for k in schemes} for _ in range(a.rounds)]
        for kernel in schemes:
            report(a, kernel, world, rounds)


if __name__ == "__main__":
    main()
