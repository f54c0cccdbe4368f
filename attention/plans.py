"""A kernel's `plan`: how its work is cut into fused calls, and which one "auto" picks.

"cpu": bounded calls whose buffers stay small (the CPU op's scratch, cache-sized parts);
"cuda": the fewest calls (dilated: segments folded into the batch, attention.dilated_plan;
block_sparse: compiled FlexAttention, attention.block_sparse.cuda), since a GPU is host-bound
on many small calls; "auto": the plan of the inputs' device type.

One rule for the meta device, for every kernel with a plan: a meta tensor stands for the
device type `attention.primitive.meta_stands_for` names (bench.plan counts a kernel's calls on
meta standing for cuda by default), and for cpu outside it.
"""

from __future__ import annotations

import torch

from attention import primitive
from attention.errors import ParamError

PLANS = ("auto", "cpu", "cuda")
"""The plans a kernel's `plan` param takes."""


def check_plan(plan: str) -> None:
    """Raise ParamError('params.plan') unless `plan` is one of PLANS."""
    if plan not in PLANS:
        raise ParamError("params.plan", f"must be one of {', '.join(PLANS)}, got {plan!r}")


def resolve_plan(plan: str, device: torch.device) -> str:
    """The plan that runs: `plan` itself, or under "auto" "cuda" for a CUDA device (or a meta
    device standing for one, primitive.meta_stands_for) and "cpu" for any other."""
    if plan != "auto":
        return plan
    return "cuda" if primitive.device_type_of(device) == "cuda" else "cpu"
