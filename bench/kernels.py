"""Single-process kernels against dense SDPA: time, FLOP/s and peak memory per sequence length.

For each --seq and kernel (dense first): forward ms and forward+backward ms (median, min, max of
--repeats after one warm-up), the FLOPs the kernel computes (`module.flops`), achieved FLOP/s and
its fraction of dense SDPA's at the same length: each forward call of a kernel is timed right
after one of dense's (alternating), and the fraction is the median of the --repeats pairs'
ratios, printed with their min-max (load on a shared machine moves between calls; neighbours
see the same load). Then forward / forward+backward peak memory above the inputs
(workers.memory.PeakMeter, the workers' meter: the bytes the allocator handed out, CUDA's
max_memory_allocated, on CPU c10's CPU allocator read through torch.profiler's memory events,
the ops' internal buffers included), with the forward floor (q, k, v, out, lse).
Each kernel first passes a correctness gate: its output on a small shape (params scaled down)
against the fp64 dense masked reference of attention.masks. One JSON line per case, a table last.
Every peak is measured before any timing, each under its own profiler session that ends before
the timings start (the profiler's overhead never reaches a time); the --budget-mib search runs
last, metered the same way. With more than one torch thread the CPU meter counts what the
calling thread allocates, which is every allocation of these kernels (the fused op sizes its
scratch by the thread count before its parallel region); see workers.memory.CpuAllocatorLedger.
dilated segments longer than --seq are cut to --seq (default w = 2048, 4096, 8192 at 4K runs
2048, 4096, 4096); each line records the params that ran. The CPU columns (process CPU time)
show the work done even when other processes share the cores; wall times then stretch.

    .venv/bin/python bench/kernels.py --seq 4096 8192 16384 --repeats 3 --device cpu
    .venv/bin/python bench/kernels.py --seq 65536 --repeats 3 --forward-only   # ~25 min here

--budget-mib M adds each kernel's maximum forward length under an M MiB CPU budget, searched
by the workers' own code (dilated segments stay as given: a segment longer than the length is
the whole sequence, see attention.dilated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import attention
from attention.masks import block_token_mask, dilated_reference, masked_attention
from attention.registry import Exact, bench_cpu_grid, exact_of
from workers.memory import PeakMeter

DEFAULT_PARAMS: dict[str, list[dict[str, Any]]] = bench_cpu_grid()
"""Each benchmarked kernel's parameter sets (its KernelSpec's bench_params.cpu)."""
GATE_SEQ = 256
GATE_TOL = 1e-4


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--kernels", nargs="+", default=list(DEFAULT_PARAMS), help="dense is added")
    ap.add_argument(
        "--params",
        default="{}",
        help="JSON {kernel: params or [params, ...]} overriding defaults (a list: one case each)",
    )
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="also search each kernel's maximum forward length under this CPU memory budget "
        "(the workers' search and protocol, in this process; --search-heads/--search-dim)",
    )
    ap.add_argument(
        "--forward-only",
        action="store_true",
        help="time and meter the forward only (at 64K one dense forward+backward takes minutes "
        "on 2 cores); the fb columns print -",
    )
    ap.add_argument("--search-heads", type=int, default=4)
    ap.add_argument("--search-dim", type=int, default=32)
    ap.add_argument("--granularity", type=int, default=512)
    return ap.parse_args()


# ---- memory -----------------------------------------------------------------------------------


def measure_peak(meter: PeakMeter, fn: Callable[[], Any]) -> int:
    """Peak bytes above what was in use before `fn` ran (its result is held until measured);
    the meter is stopped after (on CPU its profiler session must not run during timings)."""
    meter.baseline()
    try:
        meter.reset()
        result = fn()
        peak = meter.peak()
    finally:
        meter.stop()
    del result
    return peak


# ---- timing -----------------------------------------------------------------------------------


def time_ms(
    fn: Callable[[], Any], repeats: int, device: torch.device, warmup: bool = True
) -> tuple[list[float], list[float]]:
    """Wall and process-CPU milliseconds of each of `repeats` calls after one warm-up (none
    with warmup=False: the caller warmed it up).

    CUDA: wall from CUDA events. The CPU time (all threads of this process) shows the work a
    call did even when other processes share the cores and stretch its wall time.
    """
    if warmup:
        fn()
    times, cpu = [], []
    for _ in range(repeats):
        c0 = time.process_time()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return times, cpu


def stats(times: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(times), 3),
        "min": round(min(times), 3),
        "max": round(max(times), 3),
    }


# ---- correctness gate ---------------------------------------------------------------------------


def fit_params(kernel: str, params: dict[str, Any], seq: int) -> dict[str, Any]:
    """dilated (Exact.DILATED): a segment longer than the sequence is cut to the sequence (the
    JSON line shows the segment lengths that ran); other kernels run their params unchanged."""
    if exact_of(kernel) is not Exact.DILATED:
        return params
    return {**params, "segment_lengths": [min(w, seq) for w in params["segment_lengths"]]}


def gate_params(kernel: str, params: dict[str, Any], seq: int) -> dict[str, Any]:
    """The kernel's params scaled down so that they fit GATE_SEQ tokens (same code paths):
    segments (Exact.DILATED) or blocks (Exact.BLOCKS)."""
    exact = exact_of(kernel)
    if exact is Exact.DILATED:
        factor = max(1, max(params["segment_lengths"]) // GATE_SEQ)
        ws = [
            max(r, w // factor)
            for w, r in zip(params["segment_lengths"], params["dilation_rates"], strict=True)
        ]
        return {**params, "segment_lengths": ws}
    if exact is Exact.BLOCKS:
        return {**params, "block_size": max(1, params["block_size"] * GATE_SEQ // seq)}
    return params


def gate(kernel: str, params: dict[str, Any], seq: int, causal: bool) -> float:
    """Max |kernel - fp64 reference| on (1, GATE_SEQ, 4, 16) CPU fp32 inputs; raises if > tol.
    The reference is the one its KernelSpec's `exact` names (none: dense attention)."""
    small = gate_params(kernel, params, seq)
    module = attention.build(kernel, **small)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, GATE_SEQ, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out = module(q.float(), k.float(), v.float(), causal=causal).double()
    exact = exact_of(kernel)
    if exact is Exact.DILATED:
        p = module.params
        ref = dilated_reference(q, k, v, p.segment_lengths, p.dilation_rates, causal=causal)
    elif exact is Exact.BLOCKS:
        keep = block_token_mask(
            module.block_mask(GATE_SEQ), small["block_size"], causal=causal, seq_len=GATE_SEQ
        )
        ref = masked_attention(q, k, v, keep)[0]
    else:
        keep = torch.ones(GATE_SEQ, GATE_SEQ, dtype=torch.bool)
        ref = masked_attention(q, k, v, keep.tril() if causal else keep)[0]
    err = (out - ref).abs().max().item()
    if not err <= GATE_TOL:
        raise SystemExit(f"correctness gate failed: {kernel} {small}: max error {err:.3g}")
    return err


# ---- cases --------------------------------------------------------------------------------------


@dataclass
class Case:
    """One kernel at one length, ready to run: its module, inputs and the two calls timed and
    measured (forward without a graph; forward+backward to the input gradients)."""

    kernel: str
    params: dict[str, Any]
    seq: int
    module: attention.Kernel
    q: torch.Tensor
    fwd: Callable[[], Any]
    fwd_bwd: Callable[[], Any]


def make_case(kernel: str, params: dict[str, Any], seq: int, args: argparse.Namespace) -> Case:
    """Seeded inputs (the same for every kernel at a length) and the kernel built on them."""
    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    )
    b, h, d = args.batch, args.heads, args.dim
    module = attention.build(kernel, **params).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, seq, h, d, generator=g, device=device, dtype=dtype) for _ in range(3))

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return module(q, k, v, causal=args.causal)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        out = module(qg, kg, vg, causal=args.causal)
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    return Case(kernel, params, seq, module, q, fwd, fwd_bwd)


def held_beyond_output(
    meter: PeakMeter, kernel: str, params: dict[str, Any], seq: int, args: argparse.Namespace
) -> int:
    """Bytes a kernel's forward holds at its peak beyond the inputs and its own output (run once
    before it is measured): its accumulators, block outputs and the fused op's buffers."""
    case = make_case(kernel, params, seq, args)
    case.fwd()
    return measure_peak(meter, case.fwd) - case.q.numel() * case.q.element_size()


def measure_case(case: Case, meter: PeakMeter, backward: bool = True) -> dict[str, Any]:
    """Forward and forward+backward peaks above the inputs (the latter None without
    `backward`), and the forward floor; each call runs once before it is measured, so that
    one-time allocations (thread pools, the autograd engine) are not counted (they were 35 MB
    at dense's first backward)."""
    case.fwd()
    if backward:
        case.fwd_bwd()
    q = case.q
    b, seq, h, _ = q.shape
    inputs = 3 * q.numel() * q.element_size()
    floor = 4 * q.numel() * q.element_size() + b * h * seq * 4  # q, k, v, out + fp32 lse
    fwd_peak = measure_peak(meter, case.fwd)
    return {
        "fwd_peak_above_inputs_bytes": fwd_peak,
        "fwd_bwd_peak_above_inputs_bytes": measure_peak(meter, case.fwd_bwd) if backward else None,
        "inputs_bytes": inputs,
        "floor_bytes": floor,
        "fwd_peak_over_floor": (inputs + fwd_peak) / floor,
    }


def paired_ms(
    fn: Callable[[], Any], base: Callable[[], Any], repeats: int, device: torch.device
) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
    """(wall, CPU) ms of `fn` and of `base`, timed alternately: base, fn, base, fn, ... after
    one warm-up of each, so that each of fn's calls has a baseline call next to it in time. On
    a shared machine the load moves between calls; a ratio of neighbours sees the same load."""
    base()
    fn()
    mine: tuple[list[float], list[float]] = ([], [])
    theirs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for call, into in ((base, theirs), (fn, mine)):
            wall, cpu = time_ms(call, 1, device, warmup=False)
            into[0].extend(wall)
            into[1].extend(cpu)
    return mine, theirs


def time_case(case: Case, args: argparse.Namespace, baseline: Case | None = None) -> dict[str, Any]:
    """Forward and forward+backward times (wall, process CPU; the latter None with
    --forward-only) and what the kernel computes.

    With a `baseline` case (SDPA at the same length), the forward calls alternate with the
    baseline's (`paired_ms`) and the row adds each pair's ratio of achieved FLOP/s,
    `fwd_pair_ratios` (wall) and `fwd_pair_ratios_cpu`: the kernel's fraction of the
    baseline's FLOP/s is their median, and their min and max are its spread."""
    device = case.q.device
    b, seq, h, d = case.q.shape
    flops = case.module.flops(b, seq, h, d, causal=args.causal)
    flops_fb = case.module.flops(b, seq, h, d, causal=args.causal, backward=True)
    paired: dict[str, Any] = {}
    if baseline is None:
        fwd_ms, fwd_cpu_ms = time_ms(case.fwd, args.repeats, device)
    else:
        if baseline.q.shape != case.q.shape:
            raise ValueError(
                f"baseline: {baseline.kernel} on {tuple(baseline.q.shape)} cannot pair with "
                f"{case.kernel} on {tuple(case.q.shape)}: a baseline runs the same shape"
            )
        (fwd_ms, fwd_cpu_ms), (base_ms, base_cpu_ms) = paired_ms(
            case.fwd, baseline.fwd, args.repeats, device
        )
        base_flops = baseline.module.flops(b, seq, h, d, causal=args.causal)
        paired = {
            "baseline": baseline.kernel,
            "baseline_fwd_ms": base_ms,
            "baseline_fwd_cpu_ms": base_cpu_ms,
            "fwd_pair_ratios": pair_ratios(flops, fwd_ms, base_flops, base_ms),
            "fwd_pair_ratios_cpu": pair_ratios(flops, fwd_cpu_ms, base_flops, base_cpu_ms),
        }
    backward: dict[str, Any] = dict.fromkeys(("fwd_bwd_ms", "fwd_bwd_cpu_ms", "fwd_bwd_flop_s"))
    if not args.forward_only:
        fwd_bwd_ms, fwd_bwd_cpu_ms = time_ms(case.fwd_bwd, args.repeats, device)
        backward = {
            "fwd_bwd_ms": stats(fwd_bwd_ms),
            "fwd_bwd_cpu_ms": stats(fwd_bwd_cpu_ms),
            "fwd_bwd_flop_s": flops_fb / (statistics.median(fwd_bwd_ms) / 1e3),
        }
    return {
        "backend": case.module.backend,
        "fwd_ms": stats(fwd_ms),
        "fwd_cpu_ms": stats(fwd_cpu_ms),
        **backward,
        "fwd_ms_each": fwd_ms,
        "fwd_cpu_ms_each": fwd_cpu_ms,
        "flops_fwd": flops,
        "flops_fwd_bwd": flops_fb,
        "fwd_flop_s": flops / (statistics.median(fwd_ms) / 1e3),
        "fwd_flop_per_cpu_s": flops / (statistics.median(fwd_cpu_ms) / 1e3),
        **paired,
    }


def timed_in_turn(
    listed: list[tuple[int, str, dict[str, Any]]], args: argparse.Namespace, baseline_kernel: str
) -> Iterator[tuple[int, str, dict[str, Any], Case, dict[str, Any]]]:
    """(seq, kernel, params, case, timing) of each listed case made and timed in turn, its
    forward alternating with the case of `baseline_kernel` at its length (listed first at
    each length; a new length's goes first, without a baseline). Each case is dropped before
    the next is made, the baseline kept for its length: a caller deletes its own reference
    to `case` before it asks for the next."""
    baseline: Case | None = None
    for seq, kernel, params in listed:
        if kernel == baseline_kernel:  # a new length: the previous one's baseline goes first
            baseline = None
        case = make_case(kernel, params, seq, args)
        timing = time_case(case, args, baseline)
        if kernel == baseline_kernel:
            baseline = case
        yield seq, kernel, params, case, timing
        del case


def pair_ratios(
    flops: int, times: list[float], base_flops: int, base_times: list[float]
) -> list[float]:
    """Per pair i: (flops / times[i]) / (base_flops / base_times[i])."""
    return [(flops / t) / (base_flops / tb) for t, tb in zip(times, base_times, strict=True)]


def fraction_of_baseline(row: dict[str, Any], baseline: dict[str, Any], cpu: bool) -> float:
    """The row's fraction of the baseline's forward FLOP/s: the median of its pair ratios when
    it was timed alternating with the baseline, else the ratio of the two medians (the
    baseline's own row: 1)."""
    ratios = row.get("fwd_pair_ratios_cpu" if cpu else "fwd_pair_ratios")
    if ratios:
        return statistics.median(ratios)
    key = "fwd_flop_per_cpu_s" if cpu else "fwd_flop_s"
    return row[key] / baseline[key]


def spread(ratios: list[float] | None) -> str:
    """The "min-max" of a kernel's pair ratios ("" for the baseline's own row)."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""


def table(rows: list[dict[str, Any]]) -> str:
    """Wall and CPU-time columns; x SDPA and t/dense compare with dense at the same length
    (x SDPA: the median of the ratios of forward calls timed alternately with dense's, their
    min-max beside it); peak/floor is the forward's, fb/dense the forward+backward peak over
    dense's; the fb columns are - where the backward did not run (--forward-only)."""
    head = (
        f"{'kernel':<13}{'seq':>6}{'fwd ms':>9}{'fb ms':>9}{'GFLOP/s':>8}{'xSDPA':>6}"
        f"{'(min-max)':>11}{'fwd cpu ms':>11}{'cpu GFLOP/s':>12}{'xSDPA':>6}{'t/dense':>8}"
        f"{'peak/floor':>11}{'fb/dense':>9}"
    )
    lines = [head, "-" * len(head)]
    dense_cpu = {r["seq"]: r["fwd_cpu_ms"]["median"] for r in rows if r["kernel"] == "dense"}

    def train_peak(r: dict[str, Any]) -> int | None:
        above = r["fwd_bwd_peak_above_inputs_bytes"]
        return None if above is None else int(r["inputs_bytes"] + above)

    dense_fb = {r["seq"]: train_peak(r) for r in rows if r["kernel"] == "dense"}
    for r in rows:
        cpu_ms = r["fwd_cpu_ms"]["median"]
        fb_ms, fb_peak, fb_dense = r["fwd_bwd_ms"], train_peak(r), dense_fb[r["seq"]]
        fb = "-" if fb_ms is None else f"{fb_ms['median']:.1f}"
        fb_ratio = "-" if fb_peak is None or fb_dense is None else f"{fb_peak / fb_dense:.2f}"
        name = r["kernel"]
        if "block_size" in r["params"]:
            name = f"{name[:8]}/{r['params']['block_size']}"
        lines.append(
            f"{name:<13}{r['seq']:>6}{r['fwd_ms']['median']:>9.1f}"
            f"{fb:>9}{r['fwd_flop_s'] / 1e9:>8.1f}"
            f"{r['fwd_frac_of_sdpa']:>6.2f}{spread(r.get('fwd_pair_ratios')):>11}{cpu_ms:>11.1f}"
            f"{r['fwd_flop_per_cpu_s'] / 1e9:>12.1f}{r['fwd_frac_of_sdpa_cpu']:>6.2f}"
            f"{cpu_ms / dense_cpu[r['seq']]:>8.3f}{r['fwd_peak_over_floor']:>11.2f}"
            f"{fb_ratio:>9}"
        )
    return "\n".join(lines)


def max_lengths(cases: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    """Each case's maximum forward length under --budget-mib on CPU: the workers' own search
    (workers.search.run_search) over the workers' protocol (workers.protocol.run_case), as a
    max_seq_len sweep would run it, one JSON line per case and a table."""
    from workers.config import RunConfig  # only the max-length search uses it
    from workers.protocol import run_case as protocol_case  # only the max-length search uses it
    from workers.search import run_search  # only the max-length search uses it

    budget = int(args.budget_mib * 2**20)
    lines = [f"max forward length, CPU budget {args.budget_mib:g} MiB, h={args.search_heads} "
             f"d={args.search_dim} fp32, granularity {args.granularity}"]  # fmt: skip
    for kernel, params in cases:
        cfg = RunConfig.model_validate(
            {
                "kernel": kernel,
                "params": params,
                "seq_len": 4096,
                "num_heads": args.search_heads,
                "head_dim": args.search_dim,
                "device": "cpu",
                "memory_budget_bytes": budget,
                "warmup": 0,
                "iterations": 1,
                "search": {"start": 4096, "max": 1 << 22, "granularity": args.granularity},
            }
        )
        outcome = run_search(cfg, lambda at, first: [protocol_case(at)])
        probes = [(p.seq_len, p.outcome) for p in outcome.probes]
        row = {"kernel": kernel, "params": params, "max_seq_len": outcome.answer_seq_len}
        print(json.dumps({**row, "budget_bytes": budget, "probes": probes}), flush=True)
        lines.append(f"{kernel:<13}{json.dumps(params):<70}{outcome.answer_seq_len}")
    return "\n".join(lines)


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    """The run's setup line: versions, threads, device, repeats and the load at the start."""
    return {
        "setup": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "repeats": args.repeats,
            "warmup": 1,
            "causal": args.causal,
            "loadavg_1min": os.getloadavg()[0],
        }
    }


def _param_sets(kernel: str, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernel's parameter sets: --params' (one or a list) else DEFAULT_PARAMS'."""
    given = overrides.get(kernel, DEFAULT_PARAMS.get(kernel, {}))
    return given if isinstance(given, list) else [given]


def _measure_memory(
    listed: list[tuple[int, str, dict[str, Any]]], args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """Each listed case's correctness gate error and peaks, in order (before any timing)."""
    meter = PeakMeter(device)
    measured = []
    for seq, kernel, params in listed:
        attention.validate(kernel, params, seq_len=seq, num_heads=args.heads)
        err = gate(kernel, params, seq, args.causal)
        measured.append(
            {
                "gate_max_err": err,
                **measure_case(make_case(kernel, params, seq, args), meter, not args.forward_only),
            }
        )
    return measured


def _time_rows(
    listed: list[tuple[int, str, dict[str, Any]]],
    measured: list[dict[str, Any]],
    args: argparse.Namespace,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Time each listed case, its forward alternating with dense's at its length; a row each
    (printed as a JSON line as it comes) with its times, x SDPA and its memory."""
    rows = []
    dense: dict[str, Any] = {}
    timed = timed_in_turn(listed, args, "dense")  # every kernel's forward alternates with dense
    for (seq, kernel, params, case, timing), memory in zip(timed, measured, strict=True):
        if kernel == "dense":
            dense = timing
        row = {
            "kernel": kernel,
            "params": params,
            "seq": seq,
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.dim,
            "causal": args.causal,
            "dtype": str(case.q.dtype).removeprefix("torch."),
            "device": device.type,
            **timing,
            "fwd_frac_of_sdpa": fraction_of_baseline(timing, dense, cpu=False),
            "fwd_frac_of_sdpa_cpu": fraction_of_baseline(timing, dense, cpu=True),
            **memory,
        }
        del case
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = json.loads(args.params)
    kernels = ["dense", *[k for k in args.kernels if k != "dense"]]
    print(json.dumps(_setup(args)), flush=True)
    listed = [  # (seq, kernel, params), dense first at each length
        (seq, kernel, fit_params(kernel, params, seq))
        for seq in args.seq
        for kernel in kernels
        for params in _param_sets(kernel, overrides)
    ]
    device = torch.device(args.device)
    # Memory first (the correctness gate, the peaks), then every timing.
    measured = _measure_memory(listed, args, device)
    print(table(_time_rows(listed, measured, args, device)))
    if args.budget_mib is not None:
        cases = [(kernel, p) for kernel in kernels for p in _param_sets(kernel, overrides)]
        print(max_lengths(cases, args))


if __name__ == "__main__":
    main()
