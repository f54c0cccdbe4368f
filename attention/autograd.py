"""The one autograd pattern of every kernel that merges primitive calls into (out, lse).

The fused ops' lse carries no gradient, so such a kernel never lets autograd see a merge: its
forward runs without a graph and returns the merged (out, lse); its backward is handed the FINAL
(out, lse) and recomputes each block from them (FlashAttention-2). `MergedFunction` returns
out in the inputs' dtype, saves q, k, v, that returned out and the lse, and casts the
gradients back to the inputs' dtype one at a time, freeing each fp32 accumulator as its copy is
made (bf16: three fp32 accumulators and one bf16 copy at once, where casting all three together
held three of each). Like FlashAttention, the backward reads the output in the
inputs' dtype (its rowsum(dout * out)): an fp32 copy of a bf16 output would be held from the
forward to the backward only to sharpen that one term. The returned output is that saved
tensor, for every dtype (as FlashAttention's): editing it in place before the backward makes
autograd refuse the backward ("modified by an inplace operation"); copy it first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(q, k, v) -> merged (out, lse), without a graph: lse in the accumulator dtype, out in it or
already in the inputs' dtype."""
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(dout, q, k, v, out, lse) -> (dq, dk, dv) in the accumulator dtype."""


class MergedFunction(torch.autograd.Function):
    """`MergedFunction.apply(q, k, v, forward, backward)`: see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, forward, backward):
        out, lse = forward(q, k, v)
        out = out.to(q.dtype)  # `out` itself when it is in the inputs' dtype
        ctx.backward_fn = backward
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = list(ctx.backward_fn(dout.contiguous(), q, k, v, out, lse))
        for i, x in enumerate((q, k, v)):  # one at a time, each accumulator freed once cast:
            grads[i] = grads[i].to(x.dtype)  # 3 accumulators + 1 copy at most, not 3 + 3
        return grads[0], grads[1], grads[2], None, None


def merged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward: Forward, backward: Backward
) -> torch.Tensor:
    """Apply `MergedFunction` to contiguous q, k, v."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    out: torch.Tensor = MergedFunction.apply(q, k, v, forward, backward)
    return out


def bound_merged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *args: Any,
) -> torch.Tensor:
    """`merged_attention` of a kernel's `forward(q, k, v, *args)` and
    `backward(dout, q, k, v, out, lse, *args)`, both bound to this call's `args` (its plan,
    process group, scale)."""

    def bound_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(q, k, v, *args)

    def bound_backward(*saved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(*saved, *args)  # saved: dout, q, k, v, out, lse

    return merged_attention(q, k, v, bound_forward, bound_backward)
