"""The engine's one door into the attention package: build, layout, FLOPs, backend, validity."""

from __future__ import annotations

from typing import Any

import torch

import attention
from attention.ring.comm import rank_and_world
from attention.ring.sharded import HeadShape, ShardedKernel
from workers.config import RunConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_distributed(name: str) -> bool:
    """Whether the kernel runs one shard of a sequence per rank (a ring kernel)."""
    return bool(attention.KERNELS[name].distributed)


def shard_world(config: RunConfig) -> int:
    """How many ranks share one sequence: world_size in sequence mode, 1 in data mode."""
    return config.world_size if config.parallel == "sequence" else 1


def check_mode(config: RunConfig) -> None:
    """Sequence parallelism over several ranks needs a ring kernel; data mode a local one
    (attention.check_parallel)."""
    attention.check_parallel(config.kernel, config.parallel, config.world_size)


def is_plugin(name: str) -> bool:
    """Whether kernel `name` comes from an installed plugin (attention.plugins)."""
    return attention.KERNELS[name].plugin is not None


def gated(config: RunConfig, kind: str) -> bool:
    """Whether the run passes the correctness gate: when asked (correctness_check, a
    correctness sweep) and always for a plugin kernel, which is not ours, also inside a layer
    kernel (multihead around a plugin)."""
    inner = config.kernel
    if is_layer(inner):
        inner = attention.make_params(inner, kernel_params(config)).kernel
    return config.correctness_check or kind == "correctness" or is_plugin(inner)


def is_layer(name: str) -> bool:
    """Whether the kernel is a layer called with (batch, seq, embed_dim) tensors (multihead),
    embed_dim being the run's num_heads x head_dim; other kernels take (batch, seq, heads, dim).
    """
    return attention.KERNELS[name].input_layout == "bse"


def kernel_params(config: RunConfig) -> dict[str, Any]:
    """The params the kernel is built and validated with: config.params, plus a layer kernel's
    embed_dim = num_heads x head_dim and num_heads from the config (attention.shape_params)."""
    return attention.shape_params(
        config.kernel,
        config.params,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.kv_heads,
    )


def build(config: RunConfig, device: torch.device) -> torch.nn.Module:
    """The kernel module for this rank on `device` in config.dtype (ring kernels use the default
    process group).

    Weights (a layer kernel's projections) are drawn from torch's CPU generator seeded with
    config.seed, inside fork_rng so the caller's random state is untouched: every rank and every
    build of a config gets the same weights, in float32, then cast to config.dtype.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        module = attention.build(config.kernel, **kernel_params(config))
    return module.to(device=device, dtype=DTYPES[config.dtype])


def local_positions(
    module: torch.nn.Module, config: RunConfig, seq_len: int, rank: int, world: int
) -> torch.Tensor:
    """Global token positions this rank holds, in the order the kernel expects them.

    A ring kernel says so itself (`module.local_positions`: its layout, and Hilbert order when
    it has ordering='hilbert'); a single-process kernel holds every position in natural order
    (it permutes internally).
    """
    own = getattr(module, "local_positions", None)
    if own is None:
        if world != 1:
            raise ValueError(f"kernel {config.kernel!r} cannot hold a shard of {world} ranks")
        return torch.arange(seq_len)
    return own(seq_len, rank, world, causal=config.causal)


def flops(
    module: torch.nn.Module, config: RunConfig, batch: int, seq_len: int, train: bool
) -> float:
    """FLOPs this rank computes per iteration, from the kernel's own accounting.

    kernel.flops(..., backward=True) counts forward plus backward (3.5x forward). A layer
    kernel (multihead) adds its projections; its embed_dim is config.num_heads x head_dim by
    construction (build), and it refuses any other shape.
    """
    args = (batch, seq_len, config.num_heads, config.head_dim, config.causal)
    return float(module.flops(*args, backward=train))


def kept_pairs(module: torch.nn.Module, config: RunConfig, seq_len: int) -> int | None:
    """Query-key pairs this rank computes for a local shard of `seq_len` tokens, summed over
    the heads, one sequence (the sharded kernel's own rank_pairs, as its FLOPs count them);
    None for a kernel that does not count pairs per rank (not sharded, or no rank_pairs: ulysses
    runs the whole sequence on every rank for its heads)."""
    if not isinstance(module, ShardedKernel) or type(module).rank_pairs is ShardedKernel.rank_pairs:
        return None
    rank, world = rank_and_world(module.params.group)
    return int(module.rank_pairs(seq_len, config.num_heads, config.causal, rank, world))


def comm_bytes(
    module: torch.nn.Module, config: RunConfig, seq_len: int, train: bool
) -> tuple[int | None, int | None]:
    """(comm_bytes, wasted_comm_bytes): the K/V bytes this rank receives per iteration for a
    local shard of `seq_len` tokens, its whole local batch (in train mode the backward
    receives them again), and of those the bytes of rows none of its queries keeps a pair
    with (the kernel's own kv_comm_bytes from its mask and token order); (None, None) for a
    kernel that does not count them."""
    if not isinstance(module, ShardedKernel):
        return None, None
    rank, world = rank_and_world(module.params.group)
    head_bytes = config.head_dim * torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    heads = HeadShape(config.num_heads, config.kv_heads, head_bytes)
    counted = module.kv_comm_bytes(seq_len, heads, config.causal, rank, world)
    if counted is None:
        return None, None
    times = config.local_batch * (2 if train else 1)
    return counted[0] * times, counted[1] * times


def backend_of(module: torch.nn.Module) -> str:
    """Name of the backend the kernel last ran on (e.g. sdpa-flash-cpu)."""
    backend = getattr(module, "backend", None)
    if callable(backend):
        backend = backend()
    if backend is None:
        raise RuntimeError(f"kernel {type(module).__name__} does not report its backend")
    return str(backend)


def plan_of(module: torch.nn.Module) -> str | None:
    """The execution plan the kernel's last call ran (attention.base.Kernel.plan): "cpu" or
    "cuda" for the kernels that choose one by device, None for the others."""
    plan = getattr(module, "plan", None)
    return None if plan is None else str(plan)


def is_valid_length(config: RunConfig, seq_len: int) -> bool:
    """Whether the kernel accepts this total length at the config's world size."""
    try:
        attention.validate(
            config.kernel,
            kernel_params(config),
            seq_len=seq_len,
            world_size=shard_world(config),
            num_heads=config.num_heads,
            causal=config.causal,
        )
    except ValueError:
        return False
    return True
