"""Ring kernels on W ranks against their single-process twin on the full sequence, same cores.

CPU (default): W gloo ranks with one thread each vs one process with W threads running the twin
on all the tokens; forward and forward+backward times (median of --repeats after a short warm-up;
a rank's time is the slowest rank's), the ratio ring/twin (twin and ring run alternately for
--rounds rounds and the median of the rounds' ratios is reported, so that a noisy machine's drift
falls on both sides of a ratio), and each process's peak memory above
its baseline (workers.memory.PeakMeter, as a sweep measures; inputs included). Also the
peak per rank at --mem-world ranks against the single process. CUDA (--device cuda, one GPU per
rank, NCCL): the same cases in bf16 with CUDA events, TFLOP/s per GPU and max_memory_allocated.
Every ring case first passes a correctness gate (a short sequence vs the twin on full tensors).

    .venv/bin/python bench/ring.py [--seq 16384] [--world 2] [--mem-world 4] [--repeats 3]
        [--rounds 3] [--kernel ring] [--params '{}'] [--device cpu] [--cases full,...]

--steps: where the time goes instead (attention.ring.steps). Non-causal, contiguous, for each
world size of --step-worlds at --seq and, at the first world size, each total length of
--step-seqs (so tokens per rank grow): the exposed-communication share (time blocked on
transfers / time in steps, all ranks), the accounting (the sum of a rank's step times over its
measured iteration time), and the instrumentation's cost: iterations with the step clock on
and off alternate, and the overhead is the median over pairs of (on / off - 1) of the slowest
rank's times.

    .venv/bin/python bench/ring.py --steps [--seq 16384] [--step-worlds 2,4]
        [--step-seqs 4096,8192,16384] [--step-mode fwd|fwd_bwd] [--repeats 6]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attention
from attention import layouts
from attention.ring.steps import StepClock, clock
from workers.memory import PeakMeter

TWINS = {
    name: spec.twin
    for name, spec in attention.registry.KERNELS.items()
    if spec.distributed and spec.twin is not None
}
"""Each ring kernel's single-process twin, from the registry (the one home of that fact)."""
GATE_SEQ = 512
GATE_TOL = 1e-4
CASES = {
    "full": (False, "contiguous"),
    "causal-zigzag": (True, "zigzag"),
    "causal-contiguous": (True, "contiguous"),
    "causal-striped": (True, "striped"),
}
"""--cases names: (causal, the ring's layout)."""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384, help="total tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=2, help="ranks of the timed ring")
    ap.add_argument("--mem-world", type=int, default=4, help="ranks of the memory case (0: skip)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="twin and ring run alternately this many times per case; the ratio is the median "
        "of the rounds' ratios (a shared, noisy machine drifts between runs taken far apart)",
    )
    ap.add_argument("--kernel", default="ring", choices=sorted(TWINS))
    ap.add_argument("--params", default="{}", help="JSON params of the ring kernel")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--cases",
        default="full,causal-zigzag,causal-contiguous",
        help="comma list of full | causal-zigzag | causal-contiguous | causal-striped",
    )
    ap.add_argument("--steps", action="store_true", help="where the time goes (see above)")
    ap.add_argument("--step-worlds", default="2,4", help="world sizes of the steps study")
    ap.add_argument("--step-seqs", default="4096,8192,16384", help="lengths at the first world")
    ap.add_argument("--step-mode", default="fwd", choices=["fwd", "fwd_bwd"])
    return ap.parse_args()


# ---- one process's work -----------------------------------------------------------------------


def _inputs(args: dict, seq: int, device: torch.device, dtype: torch.dtype, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    shape = (args["batch"], seq, args["heads"], args["dim"])
    return [torch.randn(*shape, generator=g).to(device, dtype) for _ in range(4)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _time_call(fn: Any, device: torch.device) -> float:
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def warm_up(args: dict, module: torch.nn.Module, layout: str, causal: bool) -> None:
    """One short forward+backward, so that code pages, thread pools and gloo's first buffers
    are in place before the memory baseline is taken."""
    device = torch.device(args["device_name"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, dout = (
        layouts.shard(t, layout, rank, world)
        for t in _inputs(args, GATE_SEQ, device, torch.float32, seed=7)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    module(q, k, v, causal=causal).backward(dout)


def gate(args: dict, module: torch.nn.Module, twin: torch.nn.Module, layout: str, causal: bool):
    """Raise unless the ring output on a short sequence equals the twin's on the full tensors."""
    device, dtype = torch.device(args["device_name"]), torch.float32
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, _ = _inputs(args, GATE_SEQ, device, dtype, seed=123)
    with torch.no_grad():
        ref = twin(q, k, v, causal=causal)
        shards = [layouts.shard(t, layout, rank, world) for t in (q, k, v)]
        got = module(*shards, causal=causal)
    err = (got.float() - layouts.shard(ref, layout, rank, world).float()).abs().max().item()
    if err > GATE_TOL:
        raise AssertionError(f"correctness gate: rank {rank} max error {err:.2e} > {GATE_TOL}")


def measure(args: dict, kernel: str, params: dict, layout: str | None, causal: bool) -> dict:
    """Time forward and forward+backward of `kernel` on this process's part; peak memory."""
    device = torch.device(args["device_name"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    module = attention.build(kernel, **params)
    in_force = layout or ("zigzag" if causal else "contiguous")
    if attention.KERNELS[kernel].distributed:
        twin_name = TWINS[kernel]
        twin_fields = set(attention.KERNELS[twin_name].params.__dataclass_fields__)
        twin = attention.build(twin_name, **{k: v for k, v in params.items() if k in twin_fields})
        gate(args, module, twin, in_force, causal)
    warm_up(args, module, in_force, causal)
    meter = PeakMeter(torch.device(args["device"]))  # the workers' meter, as a sweep reads
    meter.baseline()
    full = _inputs(args, args["seq"], torch.device("cpu"), torch.float32, seed=0)
    if world > 1:
        full = [layouts.shard(t, layout, rank, world) for t in full]
    q, k, v, dout = (t.to(device, dtype) for t in full)
    del full
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd() -> None:
        with torch.no_grad():
            module(q, k, v, causal=causal)

    def fwd_bwd() -> None:
        out = module(q, k, v, causal=causal)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    result: dict[str, Any] = {"rank": rank, "local_seq": q.shape[1], "fwd_s": []}
    # The peak spans a whole forward+backward (warm_up ran a short one already), metered
    # before any timing: the CPU meter's profiler session ends before the first timed call.
    meter.reset()
    fwd_bwd()
    result["peak_bytes"] = meter.peak()
    meter.stop()
    result["fwd_s"] = [_time_call(fwd, device) for _ in range(args["repeats"])]
    result["fwd_bwd_s"] = [_time_call(fwd_bwd, device) for _ in range(args["repeats"])]
    result["flops_fwd"] = module.flops(
        args["batch"], q.shape[1], args["heads"], args["dim"], causal
    )
    result["backend"] = getattr(module, "backend", None)
    return result


def measure_steps(args: dict, kernel: str, params: dict) -> dict:
    """--steps on this rank: iterations with the step clock on and off, alternating (on first
    in even repeats, off first in odd ones); the steps of every clocked iteration."""
    device = torch.device(args["device_name"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    module = attention.build(kernel, **{**params, "layout": "contiguous"})
    warm_up(args, module, "contiguous", False)
    full = _inputs(args, args["seq"], torch.device("cpu"), torch.float32, seed=0)
    q, k, v, dout = (layouts.shard(t, "contiguous", rank, world).to(device, dtype) for t in full)
    del full
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call() -> None:
        if args["step_mode"] == "fwd":
            with torch.no_grad():
                module(q, k, v, causal=False)
            return
        module(q, k, v, causal=False).backward(dout)
        q.grad = k.grad = v.grad = None

    call()  # a warm-up at the full length
    on_s: list[float] = []
    off_s: list[float] = []
    steps: list[list[dict]] = []
    for i in range(args["repeats"]):
        for clocked in (True, False) if i % 2 == 0 else (False, True):
            if clocked:
                clock.start(device)
                on_s.append(_time_call(call, device))
                steps.append(clock.collect())
                clock.stop()
            else:
                off_s.append(_time_call(call, device))
    return {"rank": rank, "local_seq": q.shape[1], "on_s": on_s, "off_s": off_s, "steps": steps}


def steps_line(kernel: str, seq: int, world: int, mode: str, ranks: list[dict]) -> dict:
    """The study's numbers for one case (see the module docstring)."""
    wait = sum(s["wait_s"] for r in ranks for it in r["steps"] for s in it)
    compute = sum(s["compute_s"] for r in ranks for it in r["steps"] for s in it)
    coverage = [
        sum(s["compute_s"] + s["wait_s"] for it in r["steps"] for s in it) / sum(r["on_s"])
        for r in ranks
    ]
    on = [max(t) for t in zip(*(r["on_s"] for r in ranks), strict=True)]
    off = [max(t) for t in zip(*(r["off_s"] for r in ranks), strict=True)]
    overhead = [a / b - 1 for a, b in zip(on, off, strict=True)]
    return {
        "case": "steps",
        "kernel": kernel,
        "mode": mode,
        "seq": seq,
        "world": world,
        "tokens_per_rank": ranks[0]["local_seq"],
        "exposed_comm_share": round(wait / (wait + compute), 4),
        "wait_s_per_rank": [
            round(sum(s["wait_s"] for it in r["steps"] for s in it) / len(r["steps"]), 4)
            for r in ranks
        ],
        "coverage_per_rank": [round(c, 4) for c in coverage],
        "iteration_s_on": [round(t, 4) for t in on],
        "iteration_s_off": [round(t, 4) for t in off],
        "overhead_median": round(statistics.median(overhead), 4),
        "overhead_range": [round(min(overhead), 4), round(max(overhead), 4)],
    }


def clock_cost_s(visits: int = 20_000) -> float:
    """Seconds the step clock adds to one step visit with one timed wait and one transfer
    (CPU clock; measured here, in this process, against the same loop with the clock off)."""

    def loop(c: StepClock) -> float:
        t0 = time.perf_counter()
        for i in range(visits):
            with c.step("forward", i % 4):
                posted = c.mark()
                c.sent(1024)
                with c.waiting():
                    pass
                c.received(1024, posted)
            if i % 64 == 63:
                c.collect()
        return time.perf_counter() - t0

    on, off = StepClock(), StepClock()
    on.start(torch.device("cpu"))
    costs = [(loop(on) - loop(off)) / visits for _ in range(5)]
    return statistics.median(costs)


def steps_study(a: argparse.Namespace, args: dict) -> None:
    """--steps: every case of the study, one JSON line and one readable line each."""
    params = json.loads(a.params)
    worlds = [int(w) for w in a.step_worlds.split(",") if w]
    cases = [(a.seq, w) for w in worlds]
    cases += [(s, worlds[0]) for s in (int(x) for x in a.step_seqs.split(",") if x) if s != a.seq]
    print(
        f"setup: --steps {a.kernel} {a.step_mode}, non-causal contiguous, batch {a.batch}, heads "
        f"{a.heads}, head_dim {a.dim}, {'fp32 cpu, gloo' if a.device == 'cpu' else 'bf16, nccl'}"
        f", 1 thread per rank; {a.repeats} repeats, step clock on and off alternating; "
        f"os.cpu_count()={os.cpu_count()}"
    )
    cost = clock_cost_s()
    print(json.dumps({"case": "clock cost per step visit", "seconds": cost}))
    print(f"  the step clock costs {cost * 1e6:.2f} us per step visit (one wait, one transfer)")
    for seq, world in cases:
        job = dict(kernel=a.kernel, params=params, threads=1, distributed=True, steps=True)
        ranks = run_job({**args, "seq": seq}, job, world)
        line = steps_line(a.kernel, seq, world, a.step_mode, ranks)
        print(json.dumps(line))
        print(
            f"  W={world} seq {seq:,} ({line['tokens_per_rank']:,} per rank): exposed comm "
            f"{line['exposed_comm_share']:.1%}, steps cover "
            f"{', '.join(f'{c:.1%}' for c in line['coverage_per_rank'])} of each rank's "
            f"iterations; clock overhead {line['overhead_median']:+.1%} (range "
            f"{line['overhead_range'][0]:+.1%} .. {line['overhead_range'][1]:+.1%})"
        )


# ---- processes ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, args: dict, job: dict, out: Any) -> None:
    try:
        torch.set_num_threads(job["threads"])
        if world > 1 or job["distributed"]:
            backend = "nccl" if args["device"] == "cuda" else "gloo"
            if args["device"] == "cuda":
                torch.cuda.set_device(rank)
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=600),
            )
        if args["device"] == "cuda":
            args = {**args, "device_name": f"cuda:{rank}"}
        if job.get("steps"):
            res = measure_steps(args, job["kernel"], job["params"])
        else:  # a job may bring its own measure (bench.sp_schemes'), pickled by reference
            measure_case = job.get("measure", measure)
            res = measure_case(args, job["kernel"], job["params"], job["layout"], job["causal"])
        out.put(("ok", res))
    except BaseException as exc:  # the parent prints it and stops
        out.put(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


FORKSERVER_PRELOAD = ["__main__", "torch", "torch.distributed", "attention", "workers.memory"]
"""What the forkserver imports once, so that each job's processes are forks that have it: a
spawned process imported torch and attention again (about 2 s of CPU on 2 cores), which a
--rounds 2 run of one case paid nine times. No process state is shared: the server has only
imported modules (no tensor, no thread pool, no CUDA context) when it forks."""


def run_job(args: dict, job: dict, world: int) -> list[dict]:
    """Run `job` on `world` fresh processes (one when world is 1): forks of a forkserver that
    has FORKSERVER_PRELOAD imported; results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, args, job, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = []
    for _ in range(world):
        status, value = out.get()
        if status == "error":
            for p in procs:
                p.kill()
            raise SystemExit(f"bench failed: {value}")
        results.append(value)
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])


# ---- report ------------------------------------------------------------------------------------


def _median_of_slowest(results: list[dict], key: str) -> float:
    """Median over repeats of the slowest rank's time (a ring step waits for every rank)."""
    per_repeat = zip(*(r[key] for r in results), strict=True)
    return statistics.median(max(times) for times in per_repeat)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_case(a: argparse.Namespace, name: str, rounds: list[tuple[dict, list[dict]]]) -> None:
    """One JSON line and one readable line for a case: per round the twin's and the ring's
    median time and their ratio, and the median ratio over rounds; peaks of the last round."""
    line: dict[str, Any] = {"case": name, "world": a.world}
    for key in ("fwd_s", "fwd_bwd_s"):
        t_ring = [_median_of_slowest(ring, key) for _, ring in rounds]
        t_one = [statistics.median(single[key]) for single, _ in rounds]
        ratios = [r / o for r, o in zip(t_ring, t_one, strict=True)]
        line[f"{key}_ring"] = [round(t, 6) for t in t_ring]
        line[f"{key}_twin"] = [round(t, 6) for t in t_one]
        line[f"{key}_ratios"] = [round(r, 3) for r in ratios]
        line[f"{key}_ratio"] = round(statistics.median(ratios), 3)
    single, ring = rounds[-1]
    line["peak_per_rank"] = [r["peak_bytes"] for r in ring]
    line["peak_twin"] = single["peak_bytes"]
    if a.device == "cuda":
        line["tflops_per_gpu_fwd"] = [
            round(r["flops_fwd"] / statistics.median(r["fwd_s"]) / 1e12, 2) for r in ring
        ]
    print(json.dumps(line))

    def times(key: str) -> str:
        pairs = zip(line[f"{key}_ring"], line[f"{key}_twin"], strict=True)
        return ", ".join(f"{r:.3f}/{o:.3f}" for r, o in pairs)

    print(
        f"  {name:18s} ratio fwd {line['fwd_s_ratio']:.2f}, fwd+bwd {line['fwd_bwd_s_ratio']:.2f} "
        f"(median of {len(rounds)} rounds; ring/twin s: fwd {times('fwd_s')}; fwd+bwd "
        f"{times('fwd_bwd_s')}); peak per rank "
        f"{', '.join(_mib(p) for p in line['peak_per_rank'])} vs twin {_mib(single['peak_bytes'])}"
    )


def _setup_line(a: argparse.Namespace, twin: str, threads: int) -> str:
    """What is compared, on what, and how often."""
    return (
        f"setup: {a.kernel} vs {twin}, total seq {a.seq}, batch {a.batch}, heads {a.heads}, "
        f"head_dim {a.dim}, {'fp32 cpu' if a.device == 'cpu' else 'bf16 cuda'}; ring: {a.world} "
        f"ranks x 1 thread ({'gloo' if a.device == 'cpu' else 'nccl'}); twin: 1 process x "
        f"{threads} threads; {a.repeats} repeats after a warm-up, {a.rounds} alternating rounds; "
        f"os.cpu_count()={os.cpu_count()}"
    )


def _time_case(
    a: argparse.Namespace,
    args: dict,
    name: str,
    params: dict,
    twin: str,
    twin_params: dict,
    threads: int,
) -> None:
    """One --cases entry: --rounds rounds of the twin then the ring, alternating; printed."""
    causal, layout = CASES[name]
    twin_job = dict(kernel=twin, params=twin_params, layout=None, causal=causal, threads=threads)
    job = dict(
        kernel=a.kernel,
        params={**params, "layout": layout},
        layout=layout,
        causal=causal,
        threads=1,
        distributed=True,
    )
    rounds = []
    for _ in range(a.rounds):
        single = run_job(args, {**twin_job, "distributed": False}, 1)[0]
        ring = run_job(args, job, a.world)
        rounds.append((single, ring))
    print_case(a, name, rounds)


def _memory_case(
    a: argparse.Namespace, args: dict, params: dict, twin: str, twin_params: dict, threads: int
) -> None:
    """Peak memory of a non-causal forward+backward: every ring rank at --mem-world against
    the twin in one process; a JSON line and a sentence."""
    mem_args = {**args, "repeats": 0}
    job = dict(
        kernel=a.kernel,
        params={**params, "layout": "contiguous"},
        layout="contiguous",
        causal=False,
        threads=1,
        distributed=True,
    )
    ring = run_job(mem_args, job, a.mem_world)
    one_job = dict(kernel=twin, params=twin_params, layout=None, causal=False, threads=threads)
    single = run_job(mem_args, {**one_job, "distributed": False}, 1)[0]
    worst = max(r["peak_bytes"] for r in ring)
    line = {
        "case": "memory fwd+bwd non-causal",
        "world": a.mem_world,
        "peak_per_rank": [r["peak_bytes"] for r in ring],
        "peak_twin": single["peak_bytes"],
        "ratio_worst_rank": round(worst / single["peak_bytes"], 3),
    }
    print(json.dumps(line))
    print(
        f"  memory at W={a.mem_world}: worst rank {_mib(worst)} vs single process "
        f"{_mib(single['peak_bytes'])} (ratio {line['ratio_worst_rank']:.3f})"
    )


def main() -> None:
    a = parse()
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        raise SystemExit(f"--device cuda needs {a.world} GPUs, found {torch.cuda.device_count()}")
    args = {**vars(a), "device_name": a.device}
    if a.steps:
        steps_study(a, args)
        return
    params = json.loads(a.params)
    twin = TWINS[a.kernel]
    twin_fields = set(attention.KERNELS[twin].params.__dataclass_fields__)
    twin_params = {k: v for k, v in params.items() if k in twin_fields}
    threads = a.world if a.device == "cpu" else 1
    print(_setup_line(a, twin, threads))
    for name in [c for c in a.cases.split(",") if c]:
        _time_case(a, args, name, params, twin, twin_params, threads)
    if a.mem_world:
        _memory_case(a, args, params, twin, twin_params, threads)


if __name__ == "__main__":
    main()
