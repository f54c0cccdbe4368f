"""`python -m bench.gpu`: the kernels on one GPU, torch only (no Ray, no service), one command.

What it runs (issue 21's proof, first part), for every dtype asked:
- correctness: dense, dilated and block_sparse, forward and the gradients of q, k, v, against an
  fp32 masked reference of the same definition (attention.masks) at each --check-seq (GPU: 1K
  and 16K; the issue's 32K needs a chunked reference, see GPU);
- timings: the same kernels and SDPA's flash backend (the `sdpa` kernel, backend flash: an
  unsupported shape is an error, not a fallback) at each --seq, forward and forward+backward
  (bench.kernels' protocol: one warm-up, then --repeats; CUDA events on a GPU), with each
  kernel's FLOP/s on the FLOPs it computes, its fraction of SDPA flash's, and its fraction of
  the GPU's dense peak (PEAK_TFLOPS, by device name; none on CPU);
- memory: forward peak over the floor (q, k, v, out in the input dtype, fp32 lse) and the
  forward+backward peak above the inputs, measured before any timing (bench.kernels).
It prints a markdown table and writes it with JSON lines (one per check and per case) to --out.
Ring kernels at W > 1 need NCCL over two GPUs or more: this script says so and runs none.
Not yet here (issue 21): the maximum-length search and the deliberate OOM / 8 GB budget runs.

On CPU (no GPU, or --device cpu) it runs tiny shapes in fp32 so that CI keeps it working:

    python -m bench.gpu --out /tmp/gpu            # the GPU defaults on a GPU, tiny on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch

import attention
from attention.masks import block_token_mask, dilated_reference, masked_attention
from bench.kernels import PeakMemory, make_case, measure_case, time_case

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
"""Dense bf16/fp16 tensor-core peak (TFLOP/s, without sparsity) by a substring of the device
name; the first match wins."""
CHECK_ATOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
"""Max abs error against the fp32 reference, as the workers' correctness check allows
(workers.protocol.CHECK_ATOL; not imported: this script must run without pydantic)."""
KERNELS: dict[str, dict[str, Any]] = {
    "dilated": {
        "segment_lengths": [2048, 4096, 8192, 16384, 32768],
        "dilation_rates": [1, 2, 4, 6, 12],
    },
    "block_sparse": {"block_size": 128, "pattern": "local_window", "sparsity_ratio": 0.25},
}
"""The sparse kernels' params at GPU lengths (LongNet's segments up to 32K; FlexAttention's
block size); at CPU lengths segments and blocks scale down (`scaled`)."""
GPU = {"seq": [16384, 32768, 65536, 131072], "check_seq": [1024, 16384], "heads": 16, "dim": 128}
"""The GPU defaults. Checks stop at 16K: the dilated reference keeps about 4 x seq^2 fp32 per
branch for its gradients (16 GB a branch at 32K, five branches), so 32K needs a reference
computed by query chunks, not written yet."""
CPU = {"seq": [256], "check_seq": [128], "heads": 2, "dim": 16}


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
    """The kernel's params for `seq`: segments cut to the sequence (the kernel would do the
    same), at CPU lengths scaled down by 32768 / seq; block size at most seq / 8."""
    params = dict(KERNELS.get(kernel, {}))
    if kernel == "dilated":
        factor = max(1, 32768 // max(seq, 1)) if seq < 1024 else 1
        params["segment_lengths"] = [
            max(r, min(seq, w // factor))
            for w, r in zip(params["segment_lengths"], params["dilation_rates"], strict=True)
        ]
    if kernel == "block_sparse":
        params["block_size"] = max(1, min(params["block_size"], seq // 8))
    return params


def peak_tflops(device: torch.device) -> float | None:
    """The GPU's dense peak from PEAK_TFLOPS, None on CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def reference(kernel: str, module: Any, q, k, v) -> torch.Tensor:
    """fp32 output of the kernel's definition, with a graph (attention.masks)."""
    seq = q.shape[1]
    if kernel == "dilated":
        p = module.params
        return dilated_reference(q, k, v, p.segment_lengths, p.dilation_rates)
    if kernel == "block_sparse":
        bs = module.params.block_size
        keep = block_token_mask(module.block_mask(seq), bs, seq_len=seq).to(q.device)
        return masked_attention(q, k, v, keep)[0]
    return masked_attention(q, k, v, torch.ones(seq, seq, dtype=torch.bool, device=q.device))[0]


def check(kernel: str, seq: int, dtype: str, device: torch.device) -> dict[str, Any]:
    """Max abs error of out, dq, dk, dv against the fp32 reference; one head (the reference's
    score matrix is seq^2 floats per head), batch 1."""
    params = scaled(kernel, seq)
    module = attention.build(kernel, **params).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    dim = 64 if device.type == "cuda" else 16
    inputs = [torch.randn(1, seq, 1, dim, generator=g, device=device) for _ in range(4)]
    q, k, v = (t.to(getattr(torch, dtype)).requires_grad_() for t in inputs[:3])
    dout = inputs[3].to(q.dtype)
    out = module(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(kernel, module, q32, k32, v32)
    refs = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    errors = {
        name: (a.float() - b).abs().max().item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *refs), strict=True)
    }
    worst = max(errors.values())
    return {
        "check": kernel,
        "params": params,
        "seq": seq,
        "dtype": dtype,
        "backend": module.backend,
        "max_abs_error": errors,
        "tolerance": CHECK_ATOL[dtype],
        "ok": bool(worst <= CHECK_ATOL[dtype]),  # NaN fails
    }


def timed_rows(args: argparse.Namespace, dtype: str, device: torch.device) -> list[dict[str, Any]]:
    """Every kernel (and SDPA flash) at every --seq: memory first, then timings."""
    ns = argparse.Namespace(
        device=args.device, dtype=dtype, batch=1, heads=args.heads, dim=args.dim,
        causal=False, repeats=args.repeats,
    )  # fmt: skip
    cases = [
        (seq, kernel, {"backend": "flash"} if kernel == "sdpa" else scaled(kernel, seq))
        for seq in args.seq
        for kernel in ("sdpa", "dense", "dilated", "block_sparse")
    ]
    meter = PeakMemory(device)
    memory = [measure_case(make_case(k, p, s, ns), meter) for s, k, p in cases]
    keep: Any = contextlib.nullcontext()
    if device.type == "cpu":
        from workers.memory import heap_keeps_freed  # torch only

        keep = heap_keeps_freed()
    rows, peak = [], peak_tflops(device)
    with keep:
        for (seq, kernel, params), mem in zip(cases, memory, strict=True):
            timing = time_case(make_case(kernel, params, seq, ns), ns)
            rows.append({"kernel": kernel, "params": params, "seq": seq, "dtype": dtype,
                         "heads": args.heads, "head_dim": args.dim, **timing, **mem})  # fmt: skip
    for row in rows:
        sdpa = next(r for r in rows if r["kernel"] == "sdpa" and r["seq"] == row["seq"])
        row["fwd_frac_of_sdpa"] = row["fwd_flop_s"] / sdpa["fwd_flop_s"]
        row["fwd_bwd_frac_of_sdpa"] = row["fwd_bwd_flop_s"] / sdpa["fwd_bwd_flop_s"]
        row["fwd_frac_of_peak"] = row["fwd_flop_s"] / (peak * 1e12) if peak else None
    return rows


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(checks: list[dict[str, Any]], rows: list[dict[str, Any]], setup: dict) -> str:
    """The report: setup, the checks, then one table row per timed case."""
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
              "| fwd+bwd x SDPA | x GPU peak | peak/floor | fwd+bwd peak MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['seq']} | {r['dtype']} | {r['fwd_ms']['median']:.2f} | "
            f"{r['fwd_bwd_ms']['median']:.2f} | {r['fwd_flop_s'] / 1e12:.3f} | "
            f"{r['fwd_frac_of_sdpa']:.2f} | {r['fwd_bwd_frac_of_sdpa']:.2f} | "
            f"{_cell(r['fwd_frac_of_peak'], '.2f')} | {r['fwd_peak_over_floor']:.2f} | "
            f"{r['fwd_bwd_peak_above_inputs_bytes'] / 2**20:.1f} |"
        )
    lines += ["", "Ring kernels at W > 1 need NCCL over two or more GPUs: not run by this script."]
    return "\n".join(lines) + "\n"


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
    }
    checks = [
        check(kernel, seq, dtype, device)
        for dtype in args.dtypes
        for seq in args.check_seq
        for kernel in ("dense", "dilated", "block_sparse")
    ]
    rows = [row for dtype in args.dtypes for row in timed_rows(args, dtype, device)]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.jsonl").open("w") as f:
        for line in [{"setup": setup}, *checks, *rows]:
            f.write(json.dumps(line) + "\n")
    report = markdown(checks, rows, setup)
    (args.out / "results.md").write_text(report)
    print(report)
    failed = [c for c in checks if not c["ok"]]
    for c in failed:
        print(f"correctness check failed: {c['check']} seq {c['seq']} {c['dtype']}: "
              f"{c['max_abs_error']} over {c['tolerance']}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
