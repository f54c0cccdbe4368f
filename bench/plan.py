"""Count each kernel's plan: fused calls, aten ops, host-to-device copies, syncs, transient bytes.

`python -m bench.plan [--seq 32768 131072] [--plans cpu cuda] [--json]` runs every kernel
(dense, dilated, and block_sparse once per pattern: local_window, dilated, global_local and
random at density 0.25, block 128) forward and backward on the META device under a
TorchDispatchMode, at h=16, d=128, bf16 by default (`--kv-heads` < `--heads`: k and v with
fewer heads, GQA), under each plan it accepts (a kernel whose
params have a `plan` field: cpu and cuda, forced; any other: its one plan, "-"). It prints a
table, a row as soon as it is counted (block_sparse's cpu plan at 128K takes minutes here), or
with --json one object per row (its `case` names the pattern). Nothing is computed and no GPU
is needed; every figure is exact for the shapes:

- fused calls: the fused attention ops dispatched (CUDA flash / efficient / cuDNN, the CPU flash
  op; forward and backward ops), per forward and per backward. FlexAttention (block_sparse's
  CUDA plan, every pattern, attention.block_sparse.cuda) runs here as torch's
  flex_attention higher-order op, eagerly: its forward op and its backward op (what
  torch.compile turns into one Triton kernel each on CUDA) count one fused call and one op
  each, their outputs allocated as torch's fake impl allocates them (out, lse, max; dq, dk,
  dv), and the ops its autograd wrapper dispatches around them (tracing the identity score_mod
  into graphs: a few empty tensors) count as ops;
- ops: every aten op dispatched (views, allocations and in-place ops included);
- h2d: copies from a CPU tensor to a non-CPU one (aten._to_copy, copy_); syncs: ops that read
  a device value on the host (aten._local_scalar_dense: .item(), bool(), int(); aten.nonzero);
- transient bytes: the high-water mark of the storages the ops returned and that were still
  alive, beyond the floor (forward: out in the dtype and an fp32 lse; q, k, v exist before).
  The ops' own workspaces are not seen. The backward's floor adds dout, dq, dk, dv.

What the meta run stands for: `attention.primitive.meta_stands_for(device)` (default cuda) makes
the primitive pick the fused op that device's backend calls (bf16 on CUDA: the flash op), run
through PyTorch's meta kernels of those ops, and makes `plan: auto` resolve as on that device.
dense calls F.scaled_dot_product_attention, whose dispatch on meta would take the math path: here
it is sent to the fused op SDPA picks on that device for these shapes (CUDA: flash, which cuDNN
may replace on some builds; CPU: the CPU flash op), with its autograd backward.
Ring kernels are not counted (they need a process group).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch._higher_order_ops.flex_attention import (
    flex_attention,
    flex_attention_backward,
    flex_attention_backward_fake_tensor_mode,
    flex_attention_fake_impl,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import attention
from attention import primitive

FUSED_FORWARD = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
}
FUSED = FUSED_FORWARD | {f"{name}_backward" for name in FUSED_FORWARD}
SYNCS = {"_local_scalar_dense", "nonzero"}
LONGNET = {
    "segment_lengths": [2048, 4096, 8192, 16384, 32768],
    "dilation_rates": [1, 2, 4, 6, 12],
}
"""LongNet's configuration (the paper's 5 branches): the targets of issue 37 are set on it."""
PARAMS: dict[str, dict[str, Any]] = {
    "dense": {},
    "dilated": LONGNET,
    "block_sparse": {"block_size": 128, "pattern": "local_window", "sparsity_ratio": 0.25},
}
"""Each kernel's params (`--params` replaces a kernel's)."""
BLOCK_SPARSE_PATTERNS: dict[str, dict[str, Any]] = {
    pattern: {"block_size": 128, "pattern": pattern, "sparsity_ratio": 0.25}
    for pattern in ("local_window", "dilated", "global_local", "random")
}
"""block_sparse runs each of its patterns (block 128, density 0.25; dilation 2, 1 global
block: the defaults) unless `--params` gives its params: issue 37's targets hold for any."""


def cases(kernels: list[str], given: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(kernel, case label, params) per row group: block_sparse once per pattern unless its
    params are given; the label names the pattern and its size or density ("" otherwise)."""
    result = []
    for kernel in kernels:
        if kernel == "block_sparse" and kernel not in given:
            result += [(kernel, f"{p} 0.25", ps) for p, ps in BLOCK_SPARSE_PATTERNS.items()]
        else:
            params = given.get(kernel, PARAMS.get(kernel, {}))
            label = str(params.get("pattern", "")) if kernel == "block_sparse" else ""
            result.append((kernel, label, params))
    return result


@dataclass
class Count:
    """What one phase (forward or backward) dispatched, and its live-bytes high-water mark."""

    calls: int = 0
    ops: int = 0
    h2d: int = 0
    syncs: int = 0
    peak: int = 0
    live: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)

    def live_bytes(self) -> int:
        """Bytes of the storages this phase created that are still alive (expired ones dropped)."""
        gone = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in gone:
            del self.live[k]
        return sum(nbytes for _, nbytes in self.live.values())


class Counter(TorchDispatchMode):
    """Counts every aten op into `count` (see the module docstring) and tracks the storages the
    ops return: new ones (not an input's) are held weakly with their bytes."""

    def __init__(self, count: Count) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        c = self.count
        c.ops += 1
        c.calls += name in FUSED
        c.syncs += name in SYNCS
        c.h2d += _is_h2d(name, args, kwargs)
        return self.track(func(*args, **kwargs), (args, kwargs))

    def track(self, out: Any, inputs: Any) -> Any:
        """Hold the new storages of `out` (not one of `inputs`') weakly; update the peak."""
        c = self.count
        seen: set[int] | None = None  # the inputs' storages, found only when an output is new
        for t in _tensors(out):
            key = _cdata(t)
            if key in c.live:
                continue
            seen = {_cdata(x) for x in _tensors(inputs)} if seen is None else seen
            if key not in seen:
                c.live[key] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        c.peak = max(c.peak, c.live_bytes())
        return out


@flex_attention.py_impl(Counter)
def _count_flex(mode: Counter, *args: Any) -> Any:
    """FlexAttention's forward op under a Counter: one fused call and one op, its outputs
    (out, lse, max) as the kernel's (torch's fake impl: allocations only). On CUDA the compiled
    kernel is this one op (module docstring); its eager math, which would materialize the
    (B, H, S, S) scores, is not what is counted."""
    mode.count.ops += 1
    mode.count.calls += 1
    return mode.track(flex_attention_fake_impl(*args), args)


@flex_attention_backward.py_impl(Counter)
def _count_flex_backward(mode: Counter, *args: Any) -> Any:
    """FlexAttention's backward op under a Counter: one fused call and one op (dq, dk, dv)."""
    mode.count.ops += 1
    mode.count.calls += 1
    return mode.track(flex_attention_backward_fake_tensor_mode(*args), args)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested args/outputs structure."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, list | tuple):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


def _cdata(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _is_h2d(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy from a CPU tensor to a non-CPU device (what a real run sends over the bus)."""
    if name == "_to_copy":
        dst = kwargs.get("device")
        return args[0].device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu"
    if name == "copy_":
        return args[1].device.type == "cpu" and args[0].device.type != "cpu"
    return False


class FusedSdpa(TorchFunctionMode):
    """F.scaled_dot_product_attention on meta tensors -> the fused op SDPA picks on the device
    the meta run stands for (see the module docstring), with autograd."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or args[0].device.type != "meta":
            return func(*args, **kwargs)
        q, k, v = args[:3]
        causal = bool(kwargs.get("is_causal", False))
        if self.device_type == "cuda":
            op = torch.ops.aten._scaled_dot_product_flash_attention
            return op(q, k, v, 0.0, causal, False)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[0]


def plans_of(kernel: str) -> list[str]:
    """cpu and cuda for a kernel whose params take `plan`; "-" (its one plan) otherwise."""
    fields = {f.name for f in dataclasses.fields(attention.KERNELS[kernel].params)}
    return ["cpu", "cuda"] if "plan" in fields else ["-"]


def count_plan(
    kernel: str,
    params: dict[str, Any],
    plan: str,
    *,
    seq_len: int,
    heads: int = 16,
    kv_heads: int | None = None,
    dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device_type: str = "cuda",
    causal: bool = False,
) -> dict[str, Any]:
    """One kernel's counts under `plan` ("-": none passed) at batch 1: forward, then backward
    through autograd, on meta tensors standing for `device_type`; k and v with `kv_heads` heads
    (GQA; None: `heads`). Counted on the second call:
    the first builds what a plan caches once per (pattern, length, device), as a run's warm-up
    does, so the counts are those of every timed iteration."""
    module = attention.build(kernel, **params, **({} if plan == "-" else {"plan": plan}))
    kv_heads = heads if kv_heads is None else kv_heads
    q, k, v, dout = (
        torch.empty(1, seq_len, h, dim, dtype=dtype, device="meta")
        for h in (heads, kv_heads, kv_heads, heads)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fwd, bwd = Count(), Count()
    with primitive.meta_stands_for(device_type), FusedSdpa(device_type):
        torch.autograd.grad(module(q, k, v, causal=causal), (q, k, v), dout)  # the warm-up
        with Counter(fwd):
            out = module(q, k, v, causal=causal)
        with Counter(bwd):
            torch.autograd.grad(out, (q, k, v), dout)
    one = seq_len * heads * dim * dtype.itemsize  # q, out, dout, dq
    kv = 2 * seq_len * kv_heads * dim * dtype.itemsize  # k and v, dk and dv
    floor = 2 * one + kv + seq_len * heads * 4
    return {
        "kernel": kernel, "seq_len": seq_len, "plan": plan,
        "fwd_calls": fwd.calls, "bwd_calls": bwd.calls, "fwd_ops": fwd.ops, "bwd_ops": bwd.ops,
        "h2d_copies": fwd.h2d + bwd.h2d, "syncs": fwd.syncs + bwd.syncs,
        "transient_bytes": max(0, fwd.peak - (one + seq_len * heads * 4)),
        "floor_bytes": floor,
        "bwd_transient_bytes": max(0, bwd.peak - one - kv),
        "bwd_floor_bytes": floor + 2 * one + kv,
        "backend": getattr(module, "backend", None),
    }  # fmt: skip


HEAD = (
    f"{'kernel':<13}{'case':<18}{'seq':>7} {'plan':<5}{'fwd calls':>10}{'bwd calls':>10}"
    f"{'fwd ops':>10}{'bwd ops':>11}{'h2d':>7}{'syncs':>7}{'fwd trans/floor':>16}"
    f"{'bwd trans/floor':>16}"
)
"""The table's header line (`line` writes each row under it)."""


def line(r: dict[str, Any]) -> str:
    """One row of the table (transient as a fraction of its floor)."""
    return (
        f"{r['kernel']:<13}{r.get('case', ''):<18}{r['seq_len']:>7} {r['plan']:<5}"
        f"{r['fwd_calls']:>10}{r['bwd_calls']:>10}{r['fwd_ops']:>10}{r['bwd_ops']:>11}"
        f"{r['h2d_copies']:>7}{r['syncs']:>7}{r['transient_bytes'] / r['floor_bytes']:>16.3f}"
        f"{r['bwd_transient_bytes'] / r['bwd_floor_bytes']:>16.3f}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table under HEAD."""
    return "\n".join([HEAD, *map(line, rows)])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="k, v heads (GQA); default: --heads")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="what meta stands for"
    )
    ap.add_argument("--kernels", nargs="+", default=list(PARAMS))
    ap.add_argument("--params", default="{}", help="JSON {kernel: params} over the defaults")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument(
        "--plans", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"],
        help="plans of the kernels that take one (a kernel without: its one plan)",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="one JSON object per (kernel, seq, plan)")
    return ap.parse_args(argv)


def _print(text: str) -> None:
    """print, flushed: each row shows as it is counted, piped or not."""
    print(text, flush=True)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = _print) -> None:
    """The setup line, then (table mode) the header and each row as soon as it is counted
    (a cpu plan at 128K takes minutes here), or (--json) one object per row."""
    args = parse(argv)
    dtype = getattr(torch, args.dtype)
    given = json.loads(args.params)
    groups = cases(args.kernels, given)
    setup = {
        "torch": torch.__version__, "device": "meta", "meta_stands_for": args.device,
        "batch": 1, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
        "head_dim": args.dim, "dtype": args.dtype,
        "causal": args.causal, "seq": args.seq, "plans": args.plans,
        "params": {f"{k} {label}".strip(): p for k, label, p in groups},
        "fused_op": primitive.backend_for(args.device, dtype),
    }  # fmt: skip
    emit(json.dumps({"setup": setup}))
    if not args.json:
        emit(
            f"meta stands for {args.device} ({setup['fused_op']}): exact counts of a call "
            "after one warm-up call, nothing run"
        )
        emit(HEAD)
    for seq in args.seq:
        for kernel, label, params in groups:
            for plan in plans_of(kernel):
                if plan != "-" and plan not in args.plans:
                    continue
                row = count_plan(
                    kernel, params, plan, seq_len=seq, heads=args.heads, kv_heads=args.kv_heads,
                    dim=args.dim, dtype=dtype, device_type=args.device, causal=args.causal,
                )  # fmt: skip
                row["case"] = label
                emit(json.dumps(row) if args.json else line(row))


if __name__ == "__main__":
    main()
