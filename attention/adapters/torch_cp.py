"""`torch_cp`: torch's own context parallelism (torch.distributed.tensor.experimental's
context_parallel) over SDPA, as a peer of ringlab's sequence-parallel kernels.

This rank's shard becomes a DTensor sharded on the sequence over a one-dimensional device mesh
of the world group, and SDPA runs on it under torch's context-parallel dispatcher (what the
`context_parallel` context manager enables), forward and backward; `rotate_method` is torch's
`set_rotate_method`: allgather (K/V all-gathered) or alltoall (K/V passed around the ring).
Causal runs take torch's load-balanced (head-tail) shards: the zigzag layout.

CPU: torch cannot run it. Found here on torch 2.13 CPU with 2 gloo ranks (tests/
test_torch_cp.py runs it again): context_parallel shards the buffers, then SDPA's CPU op has no
DTensor sharding strategy, and torch raises "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered." Without CUDA the adapter therefore does not load, and /api/v1/kernels lists it as
unavailable with that reason (as flash_attn without its package); it is CUDA-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attention.adapters import RingAdapter, adapter_specs, split_check
from attention.errors import ParamError
from attention.layouts import positions
from attention.registry import KernelSpec

ROTATE_METHODS = ("allgather", "alltoall")


CPU_REFUSAL = (
    "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
    "strategy registered."
)
"""What torch 2.13's DTensor dispatch raises for SDPA's CPU op, the catalogue's reason on a
machine without CUDA: stated, not looked up, so that loading the plugin does not import
torch.distributed.tensor (half a second in every process that imports attention);
tests/attention/test_torch_cp.py holds it to cpu_refusal() and to what torch raises."""


def cpu_refusal() -> str | None:
    """torch's reason its context parallelism cannot run SDPA on CPU (the message its DTensor
    dispatch raises for an op without a sharding strategy), None if it could."""
    # Imported here: DTensor costs half a second, and only this check and a CUDA run need it.
    from torch.distributed.tensor import (
        DTensor,
    )  # experimental torch API, loaded when the adapter runs

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = (prop.op_strategy_funcs, prop.op_to_rules, prop.op_single_dim_strategy_funcs)
    if any(op in table for table in tables):
        return None
    return f"Operator {op} does not have a sharding strategy registered."


@dataclass(frozen=True)
class TorchCPParams:
    """rotate_method: how torch moves K/V between ranks (its set_rotate_method)."""

    rotate_method: str = "allgather"

    def __post_init__(self) -> None:
        if self.rotate_method not in ROTATE_METHODS:
            raise ParamError(
                "params.rotate_method",
                f"must be one of {', '.join(ROTATE_METHODS)}, got {self.rotate_method!r}",
            )


def layout(params: TorchCPParams, causal: bool | None) -> str:
    """Causal (or not known yet): torch's head-tail shards, the zigzag layout; else contiguous."""
    return "contiguous" if causal is False else "zigzag"


check = split_check(layout)


class _Dispatched(torch.autograd.Function):
    """SDPA on DTensors under torch's context-parallel dispatcher, its backward too (the
    dispatcher must be on while autograd runs SDPA's backward on the DTensors)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, causal):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import (
            DTensor,
            Shard,
        )  # experimental torch API, loaded when the adapter runs

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad(), _dispatcher():
            dts = [DTensor.from_local(t.transpose(1, 2), mesh, [Shard(2)]) for t in leaves]
            out = F.scaled_dot_product_attention(*dts, is_causal=causal).to_local()
        ctx.leaves, ctx.out = leaves, out
        return out.detach().transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def]
        with _dispatcher():
            grads = torch.autograd.grad(ctx.out, ctx.leaves, dout.transpose(1, 2))
        ctx.leaves = ctx.out = None
        return (*grads, None, None)


class _dispatcher:
    """torch's context-parallel SDPA dispatch, on while open."""

    def __enter__(self) -> None:
        from torch.distributed.tensor.experimental import (
            _attention,
        )  # experimental torch API, loaded when the adapter runs

        _attention._enable_context_parallel_dispatcher()

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed.tensor.experimental import (
            _attention,
        )  # experimental torch API, loaded when the adapter runs

        _attention._disable_context_parallel_dispatcher()


class TorchCP(RingAdapter):
    """`module(q, k, v, *, causal=False)` on this rank's shard (CUDA, NCCL)."""

    def __init__(self, params: TorchCPParams) -> None:
        super().__init__(params)
        self.backend = f"torch-{torch.__version__}-context_parallel-{params.rotate_method}"
        self._mesh: Any = None

    def local_positions(
        self, seq_len: int, rank: int, world_size: int, *, causal: bool = False
    ) -> torch.Tensor:
        """Causal: torch's head-tail (zigzag) shards; else contiguous ones."""
        return positions(seq_len, layout(self.params, causal), rank, world_size)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        if q.device.type != "cuda":
            raise ValueError(f"device: torch_cp runs on CUDA only; on CPU: {cpu_refusal()}")
        from torch.distributed.device_mesh import (
            DeviceMesh,
        )  # experimental torch API, loaded when the adapter runs
        from torch.distributed.tensor.experimental import (
            _attention,
        )  # experimental torch API, loaded when the adapter runs

        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        _attention.set_rotate_method(self.params.rotate_method)
        _attention._cp_options.enable_load_balance = causal  # head-tail shards: zigzag
        return _Dispatched.apply(q, k, v, self._mesh, causal)  # type: ignore[no-any-return]


def kernel_specs() -> list[KernelSpec]:
    """The adapter's kernel; without CUDA it refuses to load, with torch's reason."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"torch_cp is CUDA-only: torch {torch.__version__}'s context_parallel cannot run "
            f"SDPA on CPU: {CPU_REFUSAL}"
        )
    return adapter_specs(
        "torch_cp",
        "torch's own context parallelism (context_parallel over SDPA), K/V rotated by all-gather "
        "or all-to-all; causal shards head-tail (zigzag).",
        TorchCPParams,
        TorchCP,
        twin="dense",
        check=check,
    )
