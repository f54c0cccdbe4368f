"""Every torch.compile the project makes, in one place: FlexAttention for block_sparse's cuda
plan and for the flex adapters (flex_dilated's masks are built from their tiles:
attention.dilated_blocks, nothing to compile).

What a compiled kernel promises (issue 49):

- fullgraph=True and dynamic=False: one graph per distinct shape, dtype, grad mode and mask
  closure, never a graph break.
- Its own cache. Dynamo keeps compiled entries on the compiled function's code object, so two
  torch.compile wrappers of the same function (flex_attention in block_sparse and in
  flex_block_sparse) share one cache and one recompile limit. Each kernel here compiles its
  own module-level function (a code object of its own), named after it.
- A recompile limit sized for a sweep, RECOMPILE_LIMIT per kernel, set around each call
  (torch._dynamo.config.patch) rather than process-wide, so code outside ours (a plugin's own
  torch.compile) keeps torch's defaults. Past it Dynamo raises (fullgraph=True), and the call
  raises RecompileLimitError naming the kernel and the shapes: torch's own fallback would run
  flex_attention unfused, materializing (B, H, S, S) scores, and time that instead.
- The backend: the setting RINGLAB_COMPILE_BACKEND (`inductor`, `eager` or `aot_eager`),
  `inductor` by default on CUDA. On CPU a setting sends every compiled kernel's CPU path
  through torch.compile with it, so Dynamo's guards and recompile counting run here as they do
  on a GPU (`eager`: tracing and guards, no code generation; `aot_eager`: AOTAutograd's forward
  and backward graphs too). Unset on CPU, block_sparse's cuda plan runs FlexAttention's op
  eagerly and the flex adapters compile with inductor, as before the setting existed.

On CPU the kernels call FlexAttention's higher-order op rather than the public flex_attention,
which refuses inputs that require grad there ("FlexAttention does not support backward on
CPU") even under torch.compile; the op's own autograd is exact. So on CPU the backward runs
the op's math backward, and compiled CPU backward code (Inductor's) is never rehearsed.

`stats()` reads Dynamo's own counters: the graphs compiled and the seconds spent compiling
(forward frames and lazily compiled backward graphs), which the engine records per run.

Dynamo is imported on first use (torch.compile, or torch's lazy `torch._dynamo` attribute), not
with this module: importing it costs about a second of CPU, and every rank process and Ray
actor imports `attention` while most never compile. Until a compilation imports it, its
counters are zero, so stats() says so without importing it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op
from torch.nn.attention import flex_attention as flex

try:  # torch >= 2.9 asks for the lse this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

BACKEND_ENV = "RINGLAB_COMPILE_BACKEND"
BACKENDS = ("inductor", "eager", "aot_eager")
RECOMPILE_LIMIT = 64
"""Compiled entries one kernel may hold in a process. A sweep's rank process meets each
(length, mode, causal, dtype, heads) cell up to three times (the gate's full and sampled
checks, the warm-up at the run's length): examples/gpu-proof.yaml's block_sparse document
makes 11 entries, compare-flex.yaml's lengths about as many. 64 holds several such sweeps in
one warm process; a kernel that recompiles on every call (a closure that changes each time)
still stops here within minutes on a GPU (20-40 s a compilation), instead of running unfused."""


class RecompileLimitError(RuntimeError):
    """A compiled kernel met more than RECOMPILE_LIMIT distinct shapes in this process."""


def setting() -> str | None:
    """RINGLAB_COMPILE_BACKEND's value (None: unset or empty); ValueError naming the setting
    and the backends it takes otherwise."""
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}: must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def backend(device_type: str, cpu_default: str | None = None) -> str | None:
    """The backend compiled kernels use on `device_type`: the setting, else inductor on CUDA
    and `cpu_default` elsewhere (None: the kernel runs uncompiled there)."""
    chosen = setting()
    if chosen is not None:
        return chosen
    return "inductor" if device_type == "cuda" else cpu_default


@dataclass(frozen=True)
class Stats:
    """Dynamo's own totals in this process: graphs compiled, seconds spent compiling."""

    compilations: int
    compile_s: float

    def since(self, before: Stats) -> Stats:
        return Stats(self.compilations - before.compilations, self.compile_s - before.compile_s)


def stats() -> Stats:
    """Dynamo's counters now: unique_graphs (one per compiled frame: with fullgraph one per
    kernel entry) and the wall time of whole-frame and lazy backward compilations. Zero while
    Dynamo is not imported: nothing in this process has compiled yet (module docstring)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return Stats(0, 0.0)
    spent = utils.calculate_time_spent()
    return Stats(int(utils.counters["stats"]["unique_graphs"]), float(spent["total_wall_time"]))


def _describe(value: Any) -> str:
    """One argument as the error names it: a tensor's shape, dtype and grad; a BlockMask's
    lengths and tile; anything else its repr (short)."""
    if isinstance(value, torch.Tensor):
        grad = " requires_grad" if value.requires_grad else ""
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}{grad}"
    if isinstance(value, flex.BlockMask):
        return f"BlockMask(seq_lengths={value.seq_lengths}, BLOCK_SIZE={value.BLOCK_SIZE})"
    return repr(value)[:80]


class Compiled:
    """One compiled kernel: `fn` under torch.compile(fullgraph=True, dynamic=False) with the
    backend the call names, at most RECOMPILE_LIMIT entries (module docstring). `calls`
    counts the calls made through it in this process."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self.calls = 0
        self._by_backend: dict[str, Callable[..., Any]] = {}

    def __call__(self, backend_name: str, *args: Any, **kwargs: Any) -> Any:
        compiled = self._by_backend.get(backend_name)
        if compiled is None:
            compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, backend=backend_name)
            self._by_backend[backend_name] = compiled
        self.calls += 1
        try:
            # torch._dynamo: torch imports it on this first access (module docstring)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            shapes = ", ".join(_describe(a) for a in (*args, *kwargs.values()))
            raise RecompileLimitError(
                f"compiled kernel {self.name!r} hit its recompile limit ({RECOMPILE_LIMIT} "
                f"shapes in this process) at ({shapes}), grad mode "
                f"{'on' if torch.is_grad_enabled() else 'off'}; it does not run uncompiled"
            ) from exc


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: flex.BlockMask,
    lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention of (B, H, S, D) q, k, v under `block_mask` at scale D^-1/2 (GQA when k
    has fewer heads): out, and with `lse` the natural log-sum-exp (B, H, S). On CUDA the
    public flex_attention; elsewhere its higher-order op (module docstring)."""
    scale = q.shape[-1] ** -0.5
    gqa = k.shape[1] != q.shape[1]
    if q.device.type == "cuda":
        extra: dict[str, Any] = {}
        if lse:
            extra = {"return_aux": AuxRequest(lse=True)} if AuxRequest else {"return_lse": True}
        got = flex.flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, **extra
        )
        if not lse:
            return got, None
        out, aux = got
        return out, aux.lse if AuxRequest else aux
    options = flex._apply_kernel_options(q, k, v, lse, None, None)
    out, log2_lse = flex_attention_op(
        q, k, v, flex._identity, block_mask.as_tuple(), scale, options
    )[:2]
    if not lse:
        return out, None
    stats_are_log2 = options.get("BACKEND") != "FLASH"
    return out, log2_lse * math.log(2.0) if stats_are_log2 else log2_lse


def block_sparse_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
    """block_sparse's cuda plan (attention.block_sparse.cuda.attention)."""
    return _flex(q, k, v, mask, lse=False)[0]


def flex_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
    """The flex_block_sparse adapter's call (attention.adapters.flex)."""
    return _flex(q, k, v, mask, lse=False)[0]


def flex_dilated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
    """One branch of the flex_dilated adapter: out and lse."""
    return _flex(q, k, v, mask, lse=True)


KERNELS: dict[str, Compiled] = {
    fn.__name__: Compiled(fn.__name__, fn)
    for fn in (block_sparse_plan, flex_block_sparse, flex_dilated)
}
"""Every compiled kernel by name (each its own function: its own code object, cache and
limit)."""
