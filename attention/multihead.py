"""`multihead`: input and output projections around any single-process kernel (layer benchmarks).

Call difference: inputs are (batch, seq, embed_dim), not (batch, seq, heads, head_dim):
`module(q, k=None, v=None, *, causal=False) -> (batch, seq, embed_dim)`; k and v default to q
(self-attention). q, k, v are projected, split into num_heads heads of embed_dim / num_heads,
run through the inner kernel and projected back. `input_layout = "bse"` tells harnesses so.

embed_dim and num_heads are the run's shape: a benchmark run (workers) sets them to its
num_heads x head_dim with `attention.shape_params`, which refuses params that contradict it;
building the layer directly needs both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from attention.base import Kernel
from attention.errors import ParamError
from attention.registry import KERNELS, KernelSpec, cuda_head_dim_problem, make_params, register

LINEAR_BACKWARD_FACTOR = 2
"""Backward FLOPs of a linear layer per forward FLOP (grad of input and of weight)."""


@dataclass(frozen=True)
class MultiheadParams:
    """The inner kernel and its parameters; embed_dim split into num_heads heads; linear bias.

    embed_dim / num_heads None: not given, the run's num_heads x head_dim sets them
    (`attention.shape_params`); given, they must agree with it. Building needs both.
    """

    kernel: str = "dense"
    kernel_params: dict[str, Any] = field(default_factory=dict)
    embed_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("embed_dim", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamError(f"params.{name}", f"expected a positive integer, got {value!r}")
        if (
            self.embed_dim is not None
            and self.num_heads is not None
            and (self.embed_dim % self.num_heads)
        ):
            raise ParamError(
                "params.embed_dim",
                f"{self.embed_dim} must be divisible by params.num_heads {self.num_heads}",
            )
        if (
            self.num_heads is not None
            and self.num_kv_heads is not None
            and self.num_heads % self.num_kv_heads
        ):
            raise ParamError(
                "params.num_kv_heads",
                f"{self.num_kv_heads} must divide params.num_heads {self.num_heads}",
            )
        if not isinstance(self.bias, bool):
            raise ParamError("params.bias", f"expected true or false, got {self.bias!r}")
        if self.kernel == "multihead" or self.kernel not in KERNELS:
            valid = sorted(k for k, s in KERNELS.items() if k != "multihead" and not s.distributed)
            raise ParamError(
                "params.kernel",
                f"unknown or unsupported kernel {self.kernel!r}; valid: {', '.join(valid)}",
            )
        if KERNELS[self.kernel].distributed:
            raise ParamError(
                "params.kernel",
                f"{self.kernel!r} runs across ranks; multihead wraps single-process kernels",
            )
        if not isinstance(self.kernel_params, dict):
            raise ParamError(
                "params.kernel_params",
                f"expected a mapping, got {type(self.kernel_params).__name__}",
            )
        self.inner_params()

    def inner_params(self) -> Any:
        """The inner kernel's parameter dataclass; its errors read params.kernel_params.<field>."""
        try:
            return make_params(self.kernel, self.kernel_params)
        except ValueError as exc:
            msg = str(exc)
            if msg.startswith("params"):
                msg = "params.kernel_params" + msg[len("params") :]
            raise ValueError(msg) from exc


def _require_shape(params: MultiheadParams) -> tuple[int, int]:
    """(embed_dim, num_heads), both set; ValueError naming the unset one otherwise."""
    embed_dim, num_heads = params.embed_dim, params.num_heads
    if embed_dim is None or num_heads is None:
        name = "embed_dim" if embed_dim is None else "num_heads"
        raise ParamError(
            f"params.{name}",
            "not set; give it, or let a run set it from its num_heads x "
            "head_dim (attention.shape_params)",
        )
    return embed_dim, num_heads


def check_multihead(
    params: MultiheadParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """The inner kernel's shape rules, with the layer's head count, which must be the run's."""
    heads = _require_shape(params)[1]
    if heads != num_heads:
        raise ParamError(
            "num_heads",
            f"the layer has params.num_heads {heads}, the run {num_heads}; "
            "attention.shape_params sets the layer's from the run's",
        )
    spec = KERNELS[params.kernel]
    if spec.check is not None:
        spec.check(
            params.inner_params(),
            seq_len=seq_len,
            world_size=world_size,
            num_heads=heads,
            causal=causal,
        )


class MultiheadAttention(Kernel):
    """Projections q/out (embed_dim x embed_dim) and k/v (embed_dim x num_kv_heads x head_dim)
    around the kernel `params.kernel`."""

    input_layout: Literal["bse"] = "bse"

    def __init__(self, params: MultiheadParams) -> None:
        super().__init__(params)
        self.embed_dim, self.num_heads = _require_shape(params)
        e, bias = self.embed_dim, params.bias
        self.num_kv_heads = params.num_kv_heads or self.num_heads
        kv = self.num_kv_heads * (e // self.num_heads)
        self.q_proj, self.out_proj = (nn.Linear(e, e, bias=bias) for _ in range(2))
        self.k_proj, self.v_proj = (nn.Linear(e, kv, bias=bias) for _ in range(2))
        self.inner = KERNELS[self.params.kernel].factory(self.params.inner_params())

    def _heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        b, s, _ = x.shape
        return proj(x).view(b, s, -1, self.embed_dim // self.num_heads)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        causal: bool = False,
    ) -> torch.Tensor:
        k = q if k is None else k
        v = q if v is None else v
        e = self.embed_dim
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3 or t.shape[-1] != e:
                raise ValueError(
                    f"{name}: expected (batch, seq, embed_dim={e}), got {tuple(t.shape)}"
                )
        if q.shape != k.shape or k.shape != v.shape:
            raise ValueError(
                f"q, k, v: shapes must match, got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        heads = self.inner(
            self._heads(q, self.q_proj),
            self._heads(k, self.k_proj),
            self._heads(v, self.v_proj),
            causal=causal,
        )
        self.backend = self.inner.backend
        return self.out_proj(heads.reshape(q.shape))

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """The projections (2 FLOPs a multiply-add: q and out embed_dim^2, k and v embed_dim x
        num_kv_heads x head_dim) plus the inner kernel's FLOPs."""
        if num_heads != self.num_heads or num_heads * head_dim != self.embed_dim:
            raise ValueError(
                f"num_heads, head_dim: this layer has {self.num_heads} heads of "
                f"{self.embed_dim // self.num_heads}, got {num_heads} x {head_dim}"
            )
        kv = self.num_kv_heads * head_dim
        proj = 2 * 2 * batch * seq_len * self.embed_dim * (self.embed_dim + kv)
        if backward:
            proj *= 1 + LINEAR_BACKWARD_FACTOR
        inner = self.inner.flops(batch, seq_len, num_heads, head_dim, causal, backward)
        return proj + inner


def inner_head_dim_problem(
    params: MultiheadParams, dtype: torch.dtype, head_dim: int
) -> str | None:
    """The inner kernel's CUDA head_dim rule: the projections keep the run's head_dim."""
    return cuda_head_dim_problem(params.kernel, params.kernel_params, dtype, head_dim)


register(
    KernelSpec(
        name="multihead",
        cuda_head_dim=inner_head_dim_problem,
        description=(
            "Input/output projections (bias) around any single-process kernel; called with "
            "(batch, seq, embed_dim) tensors, embed_dim and num_heads set from the run's "
            "num_heads x head_dim."
        ),
        params=MultiheadParams,
        factory=MultiheadAttention,
        check=check_multihead,
        input_layout=MultiheadAttention.input_layout,
        dense_baseline=True,
    )
)
