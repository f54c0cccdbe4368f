"""`offset_window`: sliding-window attention (|i - j| < window) that drops the key exactly
`bug_offset` positions before each query from position `bug_after` on: a kernel wrong only
beyond its first rows, which a gate checking 128 tokens passed. It declares the correct mask
(keep_mask, keep_rows: the example plugin's, whose sliding window it is) and its period (the
window), so the gate can catch it.
`fail_outside_gate` makes it raise when called from anywhere but the correctness gate
(workers.gate): a run that fails after its gate passed. (The gate's forward checks run under
no_grad as the timed forward does, so the grad mode no longer tells them apart.)"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import ringlab_example_kernel
import torch
from ringlab_example_kernel import SlidingWindowAttention, SlidingWindowParams, keep_mask
from torch.nn import functional as F

from attention import KernelSpec


@dataclass(frozen=True)
class OffsetParams(SlidingWindowParams):
    """The example's window (keys less than this far away) and the bug: the key bug_offset
    before each query at position >= bug_after is dropped (None: no bug); fail_outside_gate:
    raise when not called from the correctness gate."""

    window: int = 256
    bug_offset: int | None = 200
    bug_after: int = 0
    fail_outside_gate: bool = False


def _in_gate() -> bool:
    """Whether this call comes from the correctness gate: workers.gate on the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "workers.gate":
            return True
        frame = frame.f_back
    return False


class OffsetWindow(SlidingWindowAttention):
    """The example's sliding window (its correct mask and FLOPs) with the bug in its forward."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        p, n = self.params, q.shape[1]
        if p.fail_outside_gate and not _in_gate():
            raise RuntimeError("offset_window: called outside the gate (fail_outside_gate)")
        mask = keep_mask(p, n, causal, q.device)
        if p.bug_offset is not None:
            rows = torch.arange(min(p.bug_after, n), n, device=q.device)
            keys = rows - p.bug_offset
            mask[rows[keys >= 0], keys[keys >= 0]] = False  # the bug
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2)


def kernel_specs() -> list[KernelSpec]:
    """The example's spec (its correct mask, rows and period) for this kernel."""
    (example,) = ringlab_example_kernel.kernel_specs()
    description = "Sliding-window attention missing one key offset (wrong on purpose)."
    spec = dataclasses.replace(example, name="offset_window", description=description)
    return [dataclasses.replace(spec, params=OffsetParams, factory=OffsetWindow)]
