"""The one autograd pattern of every kernel that merges primitive calls into (out, lse).

The fused ops' lse carries no gradient, so such a kernel never lets autograd see a merge: its
forward runs without a graph and returns the merged (out, lse); its backward is handed the FINAL
(out, lse) and recomputes each block from them (FlashAttention-2). `MergedFunction` saves
q, k, v, out and lse, returns out in the inputs' dtype, and casts the gradients back to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(q, k, v) -> merged (out, lse) in the accumulator dtype, without a graph."""
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(dout, q, k, v, out, lse) -> (dq, dk, dv) in the accumulator dtype."""


class MergedFunction(torch.autograd.Function):
    """`MergedFunction.apply(q, k, v, forward, backward)`: see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, forward, backward):
        out, lse = forward(q, k, v)
        ctx.backward_fn = backward
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)  # for inputs in the accumulator dtype: `out` itself, saved above

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(dout.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def merged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward: Forward, backward: Backward
) -> torch.Tensor:
    """Apply `MergedFunction` to contiguous q, k, v."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    out: torch.Tensor = MergedFunction.apply(q, k, v, forward, backward)
    return out
