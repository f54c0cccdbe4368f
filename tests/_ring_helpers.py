"""What the tests of a sharded kernel against its single-process twin share: the cases (every
layout, causal or not), seeded inputs, one training call's results, and their comparison with
the twin's once the ranks' shards are put back together."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attention import layouts

LAYOUTS = ("contiguous", "zigzag", "striped")
GRADS = ("out", "dq", "dk", "dv")


def layout_cases(configs: list[Any], names: tuple[str, ...] = LAYOUTS) -> list[tuple]:
    """(config, layout, causal) for every config, layout (of `names`) and causality."""
    return [
        (cfg, layout, causal) for cfg in configs for layout in names for causal in (False, True)
    ]


def seeded_inputs(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output gradient, each of `shape`, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(4))


def trained(module: nn.Module, inputs: tuple[torch.Tensor, ...], causal: bool) -> dict:
    """out, dq, dk, dv and the kernel's own FLOPs count of one training call of `module` on
    `inputs` (q, k, v, dout: a rank's shard, or the whole sequence for a twin)."""
    q, k, v, dout = inputs
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = module(q, k, v, causal=causal)
    out.backward(dout)
    flops = module.flops(*q.shape, causal)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "flops": flops}


def assert_equals_twin(
    shards: list[dict], layout: str, ref: dict, case: Any, perm: torch.Tensor | None = None
) -> None:
    """The ranks' results (`shards`, in rank order) put back together from `layout` equal the
    twin's `ref` (rows in `perm` order: hilbert), and their FLOPs add up to the twin's."""
    for name in GRADS:
        got = layouts.unshard([shard[name] for shard in shards], layout)
        want = ref[name] if perm is None else ref[name][:, perm]
        torch.testing.assert_close(
            got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n} {case}: {m}"
        )
    assert sum(shard["flops"] for shard in shards) == ref["flops"], case
