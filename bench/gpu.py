"""`python -m bench.gpu`: the kernels on one GPU, torch only (no Ray, no service), one command.

What it runs (issue 21's proof, first part), for every dtype asked:
- correctness: the primitive's fused forward and backward with a merged lse (the GPU's aten
  flash and efficient ops; `primitive_check`), then dense, dilated and block_sparse, causal and
  not, forward and the gradients of q, k, v, against a float64 masked reference of the same
  definition (attention.masks) at each --check-seq (GPU: 1K and 32K; the reference runs by
  query chunks, each recomputed in the backward, so 32K fits: `chunked_reference`);
- timings: the same kernels and SDPA's flash backend (the `sdpa` kernel, backend flash: an
  unsupported shape is an error, not a fallback) at each --seq, forward and forward+backward
  (bench.kernels' protocol: one warm-up, then --repeats; CUDA events on a GPU; each kernel's
  forward calls alternate with SDPA's), with each kernel's FLOP/s on the FLOPs it computes,
  its fraction of SDPA flash's (the median of the alternating pairs' ratios), and its fraction of
  the GPU's dense peak (PEAK_TFLOPS, by device name; none on CPU);
- memory: forward peak over the floor (q, k, v, out in the input dtype, fp32 lse) and the
  forward+backward peak above the inputs, measured before any timing (bench.kernels).
It prints a markdown table and writes it with JSON lines (one per check and per case) to --out,
after each phase (checks, each dtype's timings, searches): a run stopped early keeps what ran.
- maximum forward length (bench.gpu_search): dilated (segments up to 32K) on the whole GPU,
  and dense, dilated and block_sparse under an 8 GB budget emulating a GTX 1080 (h=8, d=64);
  a deliberate OOM (dense inputs larger than the GPU) that must come back as "oom" with the
  bytes asked for. On CPU the budgets are emulated by the peak meter and say so;
- the environment from the real device (workers.environment.device_facts: GPU name and
  memory, driver, CUDA, torch, NCCL).
Ring kernels (ring, ring_dilated, ring_block_sparse) run at W = 1 in a one-rank process group
(NCCL on a GPU, gloo on CPU), through the same engine as at any W, checked against their
twin's reference and timed and metered like every kernel. W > 1 needs NCCL over two GPUs or
more: this script says so and runs none.

On CPU (no GPU, or --device cpu) it runs tiny shapes in fp32 so that CI keeps it working:

    python -m bench.gpu --out /tmp/gpu            # the GPU defaults on a GPU, tiny on CPU
    python -m bench.gpu --seq 32768 --check-seq 8192 --dtypes bfloat16 --repeats 2 --no-search
                                                  # the device check's
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import attention
from attention import primitive
from attention.masks import block_token_mask, dilated_reference, masked_attention
from attention.registry import Exact, bench_gpu_grid, exact_of, twin_of
from bench import gpu_search
from bench.kernels import (
    fraction_of_baseline,
    make_case,
    measure_case,
    spread,
    timed_in_turn,
)
from workers.environment import device_facts
from workers.memory import PeakMeter

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
"""Dense bf16/fp16 tensor-core peak (TFLOP/s, without sparsity) by a substring of the device
name; the first match wins."""
CHECK_ATOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
"""Max abs error against the float64 reference, as the workers' correctness check allows
(workers.protocol.CHECK_ATOL and references.REFERENCE_DTYPE; not imported: this script must run
without pydantic)."""
_GRID = bench_gpu_grid()
KERNELS: dict[str, dict[str, Any]] = {
    name: params for name, params in _GRID.items() if not attention.KERNELS[name].distributed
}
"""The single-process kernels' params at GPU lengths (their KernelSpec's bench_params.gpu:
LongNet's segments up to 32K; FlexAttention's block size); at CPU lengths segments and blocks
scale down (`scaled`). Ring kernels take their twin's."""
SINGLE = tuple(KERNELS)
RING = tuple(name for name in _GRID if name not in KERNELS)
"""The kernels checked and timed: single-process, and the ring kernels at W = 1."""
GPU = {"seq": [16384, 32768, 65536, 131072], "check_seq": [1024, 32768], "heads": 16, "dim": 128,
       "reference_rows": 1024}  # fmt: skip
"""The GPU defaults; the checks' reference runs `reference_rows` queries at a time (its masks
and scores: about 5 x rows x seq float64s per dilated branch, 1.3 GB at 32K)."""
CHECK_DIM = {"cuda": 64, "cpu": 16}
"""The checks' head_dim (one head, batch 1)."""
CPU = {"seq": [256], "check_seq": [128], "heads": 2, "dim": 16, "reference_rows": 48}
SEARCH = {
    "cuda": {"heads": 8, "dim": 64, "dtype": torch.bfloat16, "granularity": 32768,
             "whole": (1 << 20, 1 << 25), "small": (gpu_search.GTX_1080_BYTES, 1 << 17),
             "oom_seq": 1 << 27},
    "cpu": {"heads": 2, "dim": 16, "dtype": torch.float32, "granularity": 256,
            "whole": None, "small": (4 * 2**20, 1024), "oom_seq": 1 << 16},
}  # fmt: skip
"""The searches' shapes: GPU h=8 d=64 bf16 (the issue's), lengths multiples of the largest
segment; "whole": (start, cap) of dilated's search on the whole GPU (none on CPU); "small":
(budget, start) of every kernel's; "oom_seq": a dense length whose inputs exceed the device
(CPU: a 4 MiB emulated budget)."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if any")
    ap.add_argument("--seq", type=int, nargs="+", help="timed lengths (GPU: 16K-128K)")
    ap.add_argument("--check-seq", type=int, nargs="+", help="checked lengths (GPU: 1K, 32K)")
    ap.add_argument("--dtypes", nargs="+", help="GPU: bfloat16 float16; CPU: float32")
    ap.add_argument("--heads", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-gpu"))
    ap.add_argument("--no-search", action="store_true", help="skip the max-length searches")
    ap.add_argument(
        "--no-whole-search", action="store_true", help="skip the search on the whole GPU only"
    )
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = GPU if args.device == "cuda" else CPU
    for name in ("seq", "check_seq", "heads", "dim"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.dtypes is None:
        args.dtypes = ["bfloat16", "float16"] if args.device == "cuda" else ["float32"]
    for dtype in args.dtypes:
        if dtype not in CHECK_ATOL:
            ap.error(f"--dtypes: {dtype!r} is not one of {', '.join(CHECK_ATOL)}")
    return args


def scaled(kernel: str, seq: int) -> dict[str, Any]:
    """The kernel's params (a ring kernel's: its twin's) for `seq`: segments cut to the
    sequence (the kernel would do the same), at CPU lengths scaled down by 32768 / seq; block
    size at most seq / 8, and for ring_block_sparse a divisor of seq / 2 (its zigzag halves
    hold whole blocks)."""
    ring = twin_of(kernel) is not None
    exact = exact_of(kernel)
    kernel = twin_of(kernel) or kernel
    params = dict(KERNELS.get(kernel, {}))
    if exact is Exact.DILATED:
        factor = max(1, 32768 // max(seq, 1)) if seq < 1024 else 1
        params["segment_lengths"] = [
            max(r, min(seq, w // factor))
            for w, r in zip(params["segment_lengths"], params["dilation_rates"], strict=True)
        ]
    if exact is Exact.BLOCKS:
        params["block_size"] = max(1, min(params["block_size"], seq // 8))
        if ring:  # a zigzag half-shard at W = 1 must hold whole blocks
            while (seq // 2) % params["block_size"]:
                params["block_size"] -= 1
    return params


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (NCCL on a GPU, gloo on CPU), in which ring kernels
    run at W = 1 through their engine; an existing group is used as it is."""
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":  # "cuda" names no index: set_device needs one
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def peak_tflops(device: torch.device) -> float | None:
    """The GPU's dense peak from PEAK_TFLOPS, None on CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def reference(
    kernel: str, module: Any, q, k, v, causal: bool, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """Output of the kernel's definition (a ring kernel's: its twin's; attention.masks) in the
    inputs' dtype (float64 from `check`), with a graph; `rows` (c0, c1): q holds only the query
    rows c0 .. c1 - 1 of the sequence of k and v."""
    exact = exact_of(kernel)
    kernel = twin_of(kernel) or kernel
    seq = k.shape[1]
    c0, c1 = rows or (0, seq)
    if exact is Exact.DILATED:
        p = module.params
        ws, rs = p.segment_lengths, p.dilation_rates
        return dilated_reference(q, k, v, ws, rs, causal=causal, rows=(c0, c1))
    if exact is Exact.BLOCKS:
        p = module.params  # ring_block_sparse's params extend its twin's
        fields = (f.name for f in dataclasses.fields(attention.KERNELS[kernel].params) if f.init)
        twin = attention.build(kernel, **{f: getattr(p, f) for f in fields})
        bs = p.block_size
        blocks = twin.block_mask(seq)[c0 // bs : -(-c1 // bs)]
        keep = block_token_mask(blocks, bs)[c0 % bs :][: c1 - c0, :seq].to(q.device)
    else:
        keep = torch.ones(c1 - c0, seq, dtype=torch.bool, device=q.device)
    if causal:
        positions = torch.arange(seq, device=q.device)
        keep = keep & (positions[None, :] <= positions[c0:c1, None])
    return masked_attention(q, k, v, keep)[0]


def chunked_reference(kernel: str, module: Any, q, k, v, causal: bool, rows: int) -> torch.Tensor:
    """`reference` by chunks of `rows` queries, each under torch.utils.checkpoint: the graph
    keeps one chunk's masks and scores at a time (recomputed in the backward), where the whole
    reference keeps about 4 x seq^2 float64s per dilated branch (32 GB a branch at 32K)."""
    seq = q.shape[1]
    parts = [
        checkpoint(
            reference,
            kernel,
            module,
            q[:, c0 : c0 + rows],
            k,
            v,
            causal,
            (c0, min(seq, c0 + rows)),
            use_reentrant=False,
        )
        for c0 in range(0, seq, rows)
    ]
    return torch.cat(parts, dim=1)


def check(
    kernel: str,
    seq: int,
    dtype: str,
    device: torch.device,
    causal: bool = False,
    reference_rows: int | None = None,
) -> dict[str, Any]:
    """Max abs error of out, dq, dk, dv against the float64 reference (`chunked_reference`, by
    `reference_rows` queries: the device's default); one head, batch 1."""
    if reference_rows is None:
        reference_rows = (GPU if device.type == "cuda" else CPU)["reference_rows"]
    params = scaled(kernel, seq)
    module = attention.build(kernel, **params).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    dim = CHECK_DIM[device.type]
    inputs = [torch.randn(1, seq, 1, dim, generator=g, device=device) for _ in range(4)]
    q, k, v = (t.to(getattr(torch, dtype)).requires_grad_() for t in inputs[:3])
    dout = inputs[3].to(q.dtype)
    out = module(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = chunked_reference(kernel, module, q64, k64, v64, causal, reference_rows)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    errors = {
        name: (a.double() - b).abs().max().item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *refs), strict=True)
    }
    worst = max(errors.values())
    return {
        "check": kernel + (" causal" if causal else ""),
        "params": params,
        "seq": seq,
        "dtype": dtype,
        "backend": module.backend,
        "max_abs_error": errors,
        "tolerance": CHECK_ATOL[dtype],
        "ok": bool(worst <= CHECK_ATOL[dtype]),  # NaN fails
    }


PRIMITIVE_SHAPE = {"sq": 1000, "sk": 1500, "split": 700, "diagonal": 500, "heads": 4, "kv": 2}
"""The primitive check's call: 1000 queries (not a multiple of 32: the efficient op pads its
lse) against 1500 keys in two blocks [0, 700) and [700, 1500), GQA 4:2; causal: query i sees
key j <= i + 500, so each block is one of the primitive's non-square causal cases."""


def primitive_check(dtype: str, device: torch.device, causal: int) -> dict[str, Any]:
    """The primitive on this device's backend as every merging kernel uses it: two key blocks'
    (out, lse) merged, then each block's fused backward fed the FINAL merged (out, lse) (on a
    GPU: the aten flash or efficient backward op, whose lse and out conventions only a GPU can
    check), against autograd of the float64 masked reference."""
    sh = PRIMITIVE_SHAPE
    sq, sk, split, diag = sh["sq"], sh["sk"], sh["split"], sh["diagonal"] if causal else 0
    dim = 64 if device.type == "cuda" else 16
    g = torch.Generator(device=device).manual_seed(1)

    def rand(seq: int, heads: int) -> torch.Tensor:
        return torch.randn(1, seq, heads, dim, generator=g, device=device)

    q32, k32, v32 = rand(sq, sh["heads"]), rand(sk, sh["kv"]), rand(sk, sh["kv"])
    dout = rand(sq, sh["heads"]).to(getattr(torch, dtype))
    q, k, v = (t.to(dout.dtype) for t in (q32, k32, v32))
    scale = dim**-0.5
    blocks = [(slice(0, split), diag), (slice(split, sk), diag - split if causal else 0)]
    out, lse = None, None
    for keys, d in blocks:
        o_b, l_b = primitive.block_forward(
            q, k[:, keys], v[:, keys], scale=scale, causal=causal, diagonal=d
        )
        out, lse = (o_b, l_b) if out is None else primitive.merge(out, lse, o_b, l_b)
    assert out is not None and lse is not None
    grads = [torch.zeros(t.shape, device=device) for t in (q, k, v)]
    for keys, d in blocks:
        dq, dk, dv = primitive.block_backward(
            dout, q, k[:, keys], v[:, keys], out, lse, scale=scale, causal=causal, diagonal=d
        )
        grads[0] += dq
        grads[1][:, keys] += dk
        grads[2][:, keys] += dv
    ref_in = [t.to(dout.dtype).double().requires_grad_() for t in (q32, k32, v32)]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    keep = keep.tril(diag) if causal else keep
    ref, _ = masked_attention(*ref_in, keep, scale=scale)
    refs = torch.autograd.grad(ref, ref_in, dout.double())
    errors = {
        name: (a.double() - b).abs().max().item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *refs), strict=True)
    }
    return {
        "check": "primitive" + (" causal" if causal else ""),
        "params": sh,
        "seq": sq,
        "dtype": dtype,
        "backend": primitive.backend_for(device, q.dtype),
        "max_abs_error": errors,
        "tolerance": CHECK_ATOL[dtype],
        "ok": bool(max(errors.values()) <= CHECK_ATOL[dtype]),
    }


def check_list(args: argparse.Namespace) -> list[tuple[str, int, str, bool]]:
    """(kernel, seq, dtype, causal) of every kernel check, in order (scripts/device_plan.py
    budgets the same list)."""
    return [
        (kernel, seq, dtype, causal)
        for dtype in args.dtypes
        for seq in args.check_seq
        for kernel in (*SINGLE, *RING)
        for causal in (False, True)
    ]


def timed_list(args: argparse.Namespace) -> list[tuple[int, str, dict[str, Any]]]:
    """(seq, kernel, params) of every timed row of a dtype, SDPA flash first at each length."""
    return [
        (seq, kernel, {"backend": "flash"} if kernel == "sdpa" else scaled(kernel, seq))
        for seq in args.seq
        for kernel in ("sdpa", *SINGLE, *RING)
    ]


def timed_rows(args: argparse.Namespace, dtype: str, device: torch.device) -> list[dict[str, Any]]:
    """Every kernel (and SDPA flash) at every --seq: memory first, then timings."""
    ns = argparse.Namespace(
        device=args.device, dtype=dtype, batch=1, heads=args.heads, dim=args.dim,
        causal=False, repeats=args.repeats, forward_only=False,
    )  # fmt: skip
    cases = timed_list(args)
    meter = PeakMeter(device)
    memory = [measure_case(make_case(k, p, s, ns), meter) for s, k, p in cases]
    rows, peak = [], peak_tflops(device)
    timed = timed_in_turn(cases, ns, "sdpa")  # each kernel's forward alternates with SDPA's
    for (seq, kernel, params, case, timing), mem in zip(timed, memory, strict=True):
        rows.append({"kernel": kernel, "params": params, "seq": seq, "dtype": dtype,
                     "heads": args.heads, "head_dim": args.dim, **timing, **mem})  # fmt: skip
        del case
    for row in rows:
        sdpa = next(r for r in rows if r["kernel"] == "sdpa" and r["seq"] == row["seq"])
        row["fwd_frac_of_sdpa"] = fraction_of_baseline(row, sdpa, cpu=False)
        row["fwd_bwd_frac_of_sdpa"] = row["fwd_bwd_flop_s"] / sdpa["fwd_bwd_flop_s"]
        row["fwd_frac_of_peak"] = row["fwd_flop_s"] / (peak * 1e12) if peak else None
    return rows


def searches(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Maximum forward lengths (see SEARCH) and the deliberate OOM, one dict each."""
    cfg = SEARCH[device.type]
    shape = (cfg["heads"], cfg["dim"], cfg["dtype"])
    gran = cfg["granularity"]
    sized = 32768 if device.type == "cuda" else 256  # the sparse params' scale (`scaled`)
    rows = []
    if cfg["whole"] and not args.no_whole_search:
        start, cap = cfg["whole"]
        found = gpu_search.max_length(
            "dilated", scaled("dilated", sized), shape, device, None,
            start=start, granularity=gran, cap=cap,
        )  # fmt: skip
        rows.append({"search": "whole device", **found.row()})
    budget, start = cfg["small"]
    for kernel in SINGLE:
        found = gpu_search.max_length(
            kernel, scaled(kernel, sized), shape, device, budget,
            start=start, granularity=gran, cap=start << 8,
        )  # fmt: skip
        rows.append({"search": "8 GB budget" if device.type == "cuda" else "budget", **found.row()})
    oom_budget = None if device.type == "cuda" else budget
    with gpu_search.cuda_budget(device, oom_budget):
        oom = gpu_search.probe("dense", {}, cfg["oom_seq"], shape, device, oom_budget)
    rows.append({"search": "deliberate oom", "kernel": "dense", "budget_bytes": oom_budget,
                 "max_seq": None, "probes": [vars(oom)]})  # fmt: skip
    return rows


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(
    checks: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    setup: dict,
    found: list[dict[str, Any]] | None = None,
) -> str:
    """The report: setup, the checks, one table row per timed case, then the searches."""
    lines = [f"# bench.gpu on {setup['device_name']}", "", "```", json.dumps(setup), "```", ""]
    lines += ["| check | seq | dtype | backend | max abs error | tolerance | ok |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in checks:
        worst = max(c["max_abs_error"].values())
        lines.append(
            f"| {c['check']} | {c['seq']} | {c['dtype']} | {c['backend']} | {worst:.3g} | "
            f"{c['tolerance']:g} | {'yes' if c['ok'] else 'NO'} |"
        )
    lines += ["", "| kernel | seq | dtype | fwd ms | fwd+bwd ms | fwd TFLOP/s | x SDPA flash "
              "| (min-max) | fwd+bwd x SDPA | x GPU peak | peak/floor | fwd+bwd peak MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['seq']} | {r['dtype']} | {r['fwd_ms']['median']:.2f} | "
            f"{r['fwd_bwd_ms']['median']:.2f} | {r['fwd_flop_s'] / 1e12:.3f} | "
            f"{r['fwd_frac_of_sdpa']:.2f} | {spread(r.get('fwd_pair_ratios')) or '-'} | "
            f"{r['fwd_bwd_frac_of_sdpa']:.2f} | "
            f"{_cell(r['fwd_frac_of_peak'], '.2f')} | {r['fwd_peak_over_floor']:.2f} | "
            f"{r['fwd_bwd_peak_above_inputs_bytes'] / 2**20:.1f} |"
        )
    if found:
        lines += ["", "| search | kernel | budget MiB | max forward length | probes |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for f in found:
            budget = _cell(f["budget_bytes"] and f["budget_bytes"] / 2**20, ".0f")
            probes = ", ".join(
                f"{p['seq']}:{p['outcome']}"
                + (f" ({p['requested_bytes'] / 2**20:.0f} MiB)" if p["requested_bytes"] else "")
                + (" emulated" if p["emulated"] else "")
                for p in f["probes"]
            )
            lines.append(
                f"| {f['search']} | {f['kernel']} | {budget} | {f['max_seq'] or '-'} | {probes} |"
            )
    lines += ["", "Ring kernels ran at W = 1 (a one-rank group). W > 1 needs NCCL over two or more "
              "GPUs: not run by this script."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write(
    out: Path,
    setup: dict,
    checks: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    found: list[dict[str, Any]],
) -> str:
    """Write what ran so far to out/results.jsonl and out/results.md, the report returned: called
    after each phase, so a run stopped by a timeout keeps every phase that finished."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("w") as f:
        for line in [{"setup": setup}, *checks, *rows, *found]:
            f.write(json.dumps(line) + "\n")
    report = markdown(checks, rows, setup, found)
    (out / "results.md").write_text(report)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    setup = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "heads": args.heads,
        "head_dim": args.dim,
        "repeats": args.repeats,
        "peak_tflops": peak_tflops(device),
        **device_facts(device),
    }
    # fp32 on a GPU: the efficient op's backward (the flash op takes fp16/bf16 only)
    prim_dtypes = [*args.dtypes, *(["float32"] if device.type == "cuda" else [])]
    checks = [primitive_check(d, device, c) for d in dict.fromkeys(prim_dtypes) for c in (0, 1)]
    rows: list[dict[str, Any]] = []
    with one_rank_group(device):  # the ring kernels' W = 1
        checks += [
            check(k, seq, dtype, device, causal) for k, seq, dtype, causal in check_list(args)
        ]
        write(args.out, setup, checks, rows, [])
        for dtype in args.dtypes:
            rows += timed_rows(args, dtype, device)
            write(args.out, setup, checks, rows, [])
    found = [] if args.no_search else searches(args, device)
    report = write(args.out, setup, checks, rows, found)
    print(report)
    failed = [c for c in checks if not c["ok"]]
    for c in failed:
        print(f"correctness check failed: {c['check']} seq {c['seq']} {c['dtype']}: "
              f"{c['max_abs_error']} over {c['tolerance']}")  # fmt: skip
    search_failed = search_failures(found, device)
    for line in search_failed:
        print(f"search check failed: {line}")
    return 1 if failed or search_failed else 0


def search_failures(found: list[dict[str, Any]], device: torch.device) -> list[str]:
    """What the searches must show: the deliberate OOM comes back as "oom" (CPU: emulated
    "over_budget") with the bytes asked for, and a budget finds a shorter maximum than the
    whole device (dilated)."""
    problems = []
    for f in found:
        if f["search"] == "deliberate oom":
            (p,) = f["probes"]
            want = "oom" if device.type == "cuda" else "over_budget"
            if p["outcome"] != want or not p["requested_bytes"]:
                problems.append(f"deliberate oom came back as {p}")
        elif f["max_seq"] is None:
            problems.append(f"{f['search']} {f['kernel']}: no length fits")
    whole = [f for f in found if f["search"] == "whole device"]
    small = [f for f in found if f["search"] != "whole device" and f["kernel"] == "dilated"]
    if whole and small and not (small[0]["max_seq"] or 0) < (whole[0]["max_seq"] or 0):
        problems.append(f"8 GB maximum {small[0]['max_seq']} not below {whole[0]['max_seq']}")
    return problems


if __name__ == "__main__":
    raise SystemExit(main())
