"""The kernel catalogue: each kernel's name, description, parameter dataclass and constraints.

Kernel modules call `register` at import; `attention/__init__.py` imports them all and then the
installed plugins' (attention.plugins), so `KERNELS` is complete once `attention` is imported,
and `UNAVAILABLE` holds every plugin that failed to load, with its error.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from attention import primitive
from attention.errors import ParamError


@dataclass(frozen=True)
class PluginInfo:
    """Where a plugin kernel comes from: its package, version and entry point."""

    package: str
    version: str
    entry_point: str


@dataclass(frozen=True)
class Unavailable:
    """A plugin entry point that failed to load, and why."""

    name: str
    plugin: PluginInfo
    error: str


KeepMask = Callable[[Any, int, bool, torch.device], torch.Tensor]
"""(params, seq_len, causal, device) -> bool (seq_len, seq_len): query i attends to key j."""
KeepRows = Callable[[Any, int, bool, torch.Tensor], torch.Tensor]
"""(params, seq_len, causal, rows) -> bool (len(rows), seq_len), or (heads, len(rows),
seq_len): the keep-mask's rows at the query positions `rows` (a 1-D int64 tensor, on the device
the mask is wanted on), without building the (seq_len, seq_len) mask."""
Periods = Callable[[Any], tuple[int, ...]]
"""params -> the token periods of the kernel's structure (segments, windows, blocks)."""


class Exact(enum.Enum):
    """How the correctness gate computes a built-in kernel's exact output (KernelSpec.exact);
    workers.references maps each kind to its float64 reference once."""

    DENSE = "dense"
    """Einsum softmax attention on every key (causal when asked), under the block-diagonal
    document mask when the params set document_lengths."""
    DILATED = "dilated"
    """attention.masks.dilated_reference on the params' segment_lengths and dilation_rates."""
    BLOCKS = "blocks"
    """Einsum softmax attention on the tokens of the built module's block_mask."""


class CommOverlap(enum.Enum):
    """How a sharded kernel's communication adds to its compute (KernelSpec.comm_overlap): the
    time service.results.schemes predicts for it from compute C and transfers M."""

    OVERLAPPED = "overlapped"
    """The next K/V hop is posted before computing, so transfers hide behind compute: max(C, M)."""
    BLOCKING = "blocking"
    """All-to-alls or gathers the compute waits for: C + M."""
    ALL_TO_ALL_THEN_RING = "all_to_all_then_ring"
    """Blocking all-to-alls (A, from the shapes), then an overlapped ring: A + max(C, M - A)."""


@dataclass(frozen=True)
class BenchParams:
    """What the benchmarks run of a built-in kernel by default (KernelSpec.bench_params).

    `cpu`: bench.kernels' parameter sets at its CPU lengths (None: not in its default list).
    `gpu`: bench.gpu's params at GPU lengths, scaled down at CPU lengths (bench.gpu.scaled);
    a ring kernel's {} (it runs its twin's at W = 1). None: not in its default list.
    """

    cpu: tuple[dict[str, Any], ...] | None = None
    gpu: dict[str, Any] | None = None


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its parameter schema (a dataclass that validates itself) and how to build it.

    `check(params, seq_len=, world_size=, num_heads=, causal=)` raises ValueError when a run's
    shape does not fit the kernel (e.g. seq_len not divisible by a segment length at that world
    size; a ring's default layout depends on causal, None meaning not known).

    `input_layout` "bshd": the module takes (batch, seq, heads, head_dim) tensors; "bse": a layer
    taking (batch, seq, embed_dim) tensors, whose params have `embed_dim` and `num_heads` fields
    that a run sets from its own num_heads x head_dim (`shape_params`).

    `twin`: a distributed kernel's single-process twin (the same attention on one rank: its
    correctness reference and its one-rank baseline), whose params are this kernel's without
    RING_PARAMS.

    `keep_mask` (plugins): the tokens each query attends to, from which the correctness gate
    builds the plugin's reference (None: exact dense attention, causal when asked).
    `keep_rows` (plugins): the same mask's rows at given query positions; the gate's sampled
    check at a run's full length needs it beyond GATE_MASK_TOKENS (without it, keep_mask's rows
    are taken from the whole mask up to that length).
    `periods`: the token periods of the kernel's structure (a segment, window or block length):
    the gate checks every row at the smallest length holding each period twice, and its
    sampled rows at the run's length include every period boundary. None: no structure.
    `plugin`: set by attention.plugins for a plugin's kernel (None for ours).
    `primitive`: the kernel computes its blocks through attention.primitive's fused ops, so
    their CUDA head_dim limits apply (check_cuda_head_dim).
    `cuda_head_dim`: (params, dtype, head_dim) -> why the kernel cannot run head_dim on CUDA
    (None: it can), for a kernel whose CUDA ops depend on its params (block_sparse's cuda plan
    and the flex adapters run compiled FlexAttention); it replaces `primitive`'s rule.
    `reference_of`: params -> (kernel, params) whose exact reference this kernel is checked
    against, when that depends on its params (ulysses: its inner kernel's); None: the twin's.
    `exact`: how the gate computes a built-in single-process kernel's exact output (Exact;
    None: a twin's, a plugin's keep_mask, or a layer's weights decide it, else no reference).
    `default_layout`: a sharded kernel's rule for its `layout` param, (layout, causal) -> the
    layout that runs (None: the kernel is not sharded by layout).
    `comm_overlap`: how a sharded kernel's communication adds to its compute (CommOverlap).
    `dense_baseline`: the kernel computes dense attention, so its runs need no dense baseline
    of their own (service.results.baselines).
    `device_plan`: the kernel (or its params' `plan` field) picks a plan by the inputs' device
    under plan "auto" (attention.plans.resolve_plan).
    `inner`: the kernels this kernel may run on its heads (its params' `inner` names one).
    `bench_params`: the params the benchmarks run by default (BenchParams; None: none).
    """

    name: str
    description: str
    params: type
    factory: Callable[[Any], nn.Module]
    distributed: bool = False
    check: Callable[..., None] | None = None
    input_layout: Literal["bshd", "bse"] = "bshd"
    twin: str | None = None
    keep_mask: KeepMask | None = None
    keep_rows: KeepRows | None = None
    periods: Periods | None = None
    plugin: PluginInfo | None = None
    primitive: bool = False
    reference_of: Callable[[dict[str, Any]], tuple[str, dict[str, Any]]] | None = None
    cuda_head_dim: Callable[[Any, torch.dtype, int], str | None] | None = None
    heads_check: Callable[[Any, int, int, int], None] | None = None
    """(params, num_heads, num_kv_heads, world_size) -> None, raising when the ranks cannot
    split the heads (ulysses, usp); `validate` calls it when given num_kv_heads."""
    exact: Exact | None = None
    default_layout: Callable[[str | None, bool], str] | None = None
    comm_overlap: CommOverlap | None = None
    dense_baseline: bool = False
    device_plan: bool = False
    inner: tuple[str, ...] = ()
    bench_params: BenchParams | None = None
    masks: frozenset[str] = frozenset({"full", "causal"})
    """The mask kinds (attention.mask.KINDS) the kernel runs exactly: full and causal (its
    `causal` call flag) unless its params take a `mask`."""
    balances: frozenset[str] = frozenset()
    """The balances (attention.layouts.BALANCES) its params take; empty: it takes none."""


RING_PARAMS = ("layout", "group")
"""The parameters every ring kernel adds to its twin's: the shard layout and process group."""


KERNELS: dict[str, KernelSpec] = {}
UNAVAILABLE: dict[str, Unavailable] = {}
"""Plugin entry points that failed to load, by entry-point name (attention.plugins)."""


def register(spec: KernelSpec) -> KernelSpec:
    """Add a kernel to the catalogue; a second kernel with the same name is a programming error."""
    if spec.name in KERNELS:
        raise ValueError(f"kernel {spec.name!r} is registered twice")
    if not dataclasses.is_dataclass(spec.params):
        raise TypeError(f"kernel {spec.name!r}: params must be a dataclass, got {spec.params!r}")
    KERNELS[spec.name] = spec
    return spec


def exact_of(name: str) -> Exact | None:
    """The kind of exact output of kernel `name`: its own `exact`, else its twin's (None:
    neither declares one, or no such kernel)."""
    spec = KERNELS.get(name)
    if spec is None:
        return None
    if spec.exact is None and spec.twin is not None:
        return exact_of(spec.twin)
    return spec.exact


def _benchmarked(gpu: bool) -> list[str]:
    """The built-in kernels with default bench params (BenchParams.gpu when `gpu`, else .cpu),
    single-process ones first, each group in Exact's order (dense, dilated, block-sparse; a
    ring kernel by its twin's)."""
    order = list(Exact)

    def rank(name: str) -> tuple[bool, int]:
        exact = exact_of(name)
        return KERNELS[name].distributed, len(order) if exact is None else order.index(exact)

    names = [
        name
        for name, spec in KERNELS.items()
        if spec.plugin is None
        and spec.bench_params is not None
        and (spec.bench_params.gpu if gpu else spec.bench_params.cpu) is not None
    ]
    return sorted(names, key=rank)


def bench_cpu_grid() -> dict[str, list[dict[str, Any]]]:
    """bench.kernels' default grid: each benchmarked kernel's parameter sets (a copy)."""
    return {
        name: [dict(p) for p in spec.bench_params.cpu]
        for name in _benchmarked(gpu=False)
        if (spec := KERNELS[name]).bench_params is not None and spec.bench_params.cpu is not None
    }


def bench_gpu_grid() -> dict[str, dict[str, Any]]:
    """bench.gpu's default kernels and their params at GPU lengths (a copy; a ring kernel's {})."""
    return {
        name: dict(spec.bench_params.gpu)
        for name in _benchmarked(gpu=True)
        if (spec := KERNELS[name]).bench_params is not None and spec.bench_params.gpu is not None
    }


def exact_dense() -> str:
    """The built-in single-process kernel that computes exact dense attention on (batch, seq,
    heads, head_dim) tensors: every sparse kernel's default baseline and the gate's yardstick."""
    found = [
        name
        for name, spec in KERNELS.items()
        if spec.plugin is None
        and spec.exact is Exact.DENSE
        and not spec.distributed
        and spec.input_layout == "bshd"
    ]
    if len(found) != 1:
        raise RuntimeError(f"expected one exact dense kernel, found {found}")
    return found[0]


def unavailable(name: str) -> str | None:
    """Why kernel `name` cannot run when it is a plugin that failed to load (else None)."""
    bad = UNAVAILABLE.get(name)
    if bad is None or name in KERNELS:  # a kernel of that name exists: it runs
        return None
    return (
        f"kernel {name!r} is unavailable: its plugin {bad.plugin.package} {bad.plugin.version} "
        f"failed to load: {bad.error}"
    )


def _spec(name: str) -> KernelSpec:
    if (why := unavailable(name)) is not None:
        raise ParamError("kernel", why)
    if name not in KERNELS:
        raise ParamError("kernel", f"unknown kernel {name!r}; valid: {', '.join(sorted(KERNELS))}")
    return KERNELS[name]


def cuda_head_dim_problem(
    name: str, params: dict[str, Any], dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why kernel `name` with `params` cannot run `head_dim` in `dtype` on CUDA (None when it
    can): its own rule (KernelSpec.cuda_head_dim), else attention.primitive's when it computes
    through the primitive, else none. A kernel that wraps another (ulysses, multihead) asks
    this of its inner kernel."""
    spec = _spec(name)
    if spec.cuda_head_dim is not None:
        return spec.cuda_head_dim(make_params(name, params), dtype, head_dim)
    if spec.primitive:
        return primitive.cuda_head_dim_problem(dtype, head_dim)
    return None


def check_cuda_head_dim(
    name: str, dtype: torch.dtype, head_dim: int, params: dict[str, Any] | None = None
) -> None:
    """Raise ParamError("head_dim") when kernel `name` with `params` runs fused CUDA ops that
    cannot run `head_dim` in `dtype` (cuda_head_dim_problem; call it once the device is
    CUDA)."""
    problem = cuda_head_dim_problem(name, params or {}, dtype, head_dim)
    if problem is not None:
        raise ParamError("head_dim", f"{name}: {problem}")


def make_params(name: str, params: dict[str, Any]) -> Any:
    """The kernel's parameter dataclass from a dict; unknown or invalid fields raise ValueError.

    Messages start with `params.<field>:` so the service can turn them into a field path.
    """
    spec = _spec(name)
    fields = {f.name for f in dataclasses.fields(spec.params) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ParamError(
            f"params.{unknown[0]}",
            f"unknown parameter of kernel {name!r}; valid: {', '.join(sorted(fields)) or '(none)'}",
        )
    try:
        return spec.params(**params)
    except TypeError as exc:  # a missing required field
        raise ParamError("params", f"{exc}") from exc


def shape_params(
    kernel: str,
    params: dict[str, Any],
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
) -> dict[str, Any]:
    """`params` for a run of `num_heads` heads of `head_dim` (and `num_kv_heads` key/value
    heads, None: num_heads): a layer kernel's (input_layout "bse") embed_dim, num_heads and
    num_kv_heads are set to num_heads * head_dim, num_heads and num_kv_heads.

    A layer's own embed_dim / num_heads, when given (not None), must agree with the run's shape:
    a contradiction raises ValueError `params.embed_dim: ...` (or `params.num_heads: ...`)
    instead of one of the two silently winning. Other kernels' params come back unchanged.
    """
    if _spec(kernel).input_layout != "bse":
        return dict(params)
    make_params(kernel, params)  # a malformed value is reported as such, not as a contradiction
    embed_dim = num_heads * head_dim
    given_dim, given_heads = params.get("embed_dim"), params.get("num_heads")
    if given_dim is not None and given_dim != embed_dim:
        raise ParamError(
            "params.embed_dim",
            f"{given_dim} contradicts the run's num_heads x head_dim = "
            f"{num_heads} x {head_dim} = {embed_dim}; leave it unset, the run sets it",
        )
    if given_heads is not None and given_heads != num_heads:
        raise ParamError(
            "params.num_heads",
            f"{given_heads} contradicts the run's num_heads {num_heads}; "
            "leave it unset, the run sets it",
        )
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    given_kv = params.get("num_kv_heads")
    if given_kv is not None and given_kv != kv_heads:
        raise ParamError(
            "params.num_kv_heads",
            f"{given_kv} contradicts the run's num_kv_heads {kv_heads}; "
            "leave it unset, the run sets it",
        )
    return {**params, "embed_dim": embed_dim, "num_heads": num_heads, "num_kv_heads": kv_heads}


def twin_of(name: str) -> str | None:
    """The single-process twin of a distributed kernel (None for any other kernel)."""
    return _spec(name).twin


def twin_params(params: dict[str, Any]) -> dict[str, Any]:
    """A ring kernel's params as its twin takes them (RING_PARAMS dropped)."""
    return {k: v for k, v in params.items() if k not in RING_PARAMS}


def structural_periods(name: str, params: dict[str, Any]) -> tuple[int, ...]:
    """The token periods of kernel `name` built with `params` (KernelSpec.periods); a ring
    kernel's are its twin's, a layer kernel's its inner kernel's; () when it declares none."""
    spec = _spec(name)
    if spec.twin is not None and spec.periods is None:
        fields = {f.name for f in dataclasses.fields(KERNELS[spec.twin].params)}
        return structural_periods(
            spec.twin, {k: v for k, v in twin_params(params).items() if k in fields}
        )
    parsed = make_params(name, params)
    if spec.input_layout == "bse":
        return structural_periods(parsed.kernel, parsed.kernel_params or {})
    if spec.periods is None:
        return ()
    periods = tuple(int(p) for p in spec.periods(parsed))
    if any(p < 1 for p in periods):
        raise ValueError(f"kernel {name!r}: periods must be >= 1, got {periods}")
    return periods


def check_parallel(kernel: str, parallel: str, world_size: int) -> None:
    """Raise ValueError (`parallel: ...`) unless `parallel` suits the kernel: data parallelism
    runs a single-process kernel on every rank; sequence parallelism over several ranks needs a
    distributed (ring) kernel."""
    distributed = _spec(kernel).distributed
    if parallel == "data" and distributed:
        raise ParamError(
            "parallel",
            f"data runs a single-process kernel on each rank; {kernel!r} is a ring "
            f"kernel (use parallel=sequence, or its twin {twin_of(kernel)!r})",
        )
    if parallel == "sequence" and world_size > 1 and not distributed:
        rings = ", ".join(sorted(k for k, s in KERNELS.items() if s.distributed))
        raise ParamError(
            "parallel",
            f"sequence with world_size={world_size} needs a ring kernel ({rings}); "
            f"{kernel!r} runs on one rank (or use parallel=data)",
        )


def build(name: str, **params: Any) -> nn.Module:
    """Build kernel `name` with `params`; unknown names or parameters raise ValueError."""
    return _spec(name).factory(make_params(name, params))


def validate(
    kernel: str,
    params: dict[str, Any],
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
    num_kv_heads: int | None = None,
) -> None:
    """Raise ValueError unless `kernel(params)` can run `seq_len` tokens on `world_size` ranks
    (`causal` None: the rules of either, e.g. a ring's stricter default-layout rule) with
    `num_kv_heads` key/value heads (None: not checked).

    A single-process kernel needs world_size 1 (run it on several ranks with parallel=data, or
    use its ring twin); the kernel's own `check` adds its divisibility rules.
    """
    spec = _spec(kernel)
    parsed = make_params(kernel, params)
    if world_size < 1:
        raise ParamError("world_size", f"must be >= 1, got {world_size}")
    if not spec.distributed and world_size != 1:
        rings = ", ".join(sorted(k for k, s in KERNELS.items() if s.distributed))
        raise ParamError(
            "world_size",
            f"kernel {kernel!r} runs in one process; for {world_size} ranks use "
            f"parallel=data or a ring kernel ({rings or 'none registered'})",
        )
    if seq_len < 1:
        raise ParamError("seq_len", f"must be >= 1, got {seq_len}")
    if seq_len % world_size:
        raise ParamError("seq_len", f"{seq_len} must be divisible by world_size {world_size}")
    if spec.check is not None:
        spec.check(
            parsed, seq_len=seq_len, world_size=world_size, num_heads=num_heads, causal=causal
        )
    if spec.heads_check is not None and num_kv_heads is not None:
        spec.heads_check(parsed, num_heads, num_kv_heads, world_size)
