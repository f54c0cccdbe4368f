"""`ulysses`, `allgather_kv` and `usp` in real gloo processes: the unsharded output and the q,
k, v gradients equal the float64 reference of the inner kernel (dense: einsum softmax on an
explicit causal mask; dilated, block_sparse: their explicit token masks), W in {1, 2, 4}, causal
and not, grouped-query heads (replicated below W), every layout each scheme takes."""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import run_ranks

import attention
from attention import layouts
from attention.ring import comm
from attention.ring.steps import clock

pytestmark = pytest.mark.timeout(120)

BATCH, SEQ, HEADS, DIM = 2, 32, 4, 8  # 32 divides by 2 x 4 (zigzag at W=4)
DILATED = {"inner": "dilated", "segment_lengths": [8, 16], "dilation_rates": [1, 2]}
SPARSE = {"inner": "block_sparse", "block_size": 4, "pattern": "local_window", "window": 2}
PLANNED = ("dilated", "block_sparse")
"""Inner kernels that choose a plan by device (auto: cpu here)."""


def cases(world: int) -> list[tuple[str, dict, str, bool, int]]:
    """(kernel, params, layout in force, causal, num_kv_heads) to check at `world` ranks."""
    out: list[tuple[str, dict, str, bool, int]] = []
    for causal in (False, True):
        for kv in (4, 2, 1):
            out.append(("ulysses", {}, "contiguous", causal, kv))
        out.append(("ulysses", DILATED, "contiguous", causal, 2))
        out.append(("ulysses", SPARSE, "contiguous", causal, 4))
        for layout in ("contiguous", "zigzag"):
            out.append(("allgather_kv", {"layout": layout}, layout, causal, 2))
            degree = 2 if world == 4 else world
            usp = {"layout": layout, "ulysses_degree": degree}
            out.append(("usp", usp, layout, causal, 4 if causal else 1))
    return out


def inputs(seed: int, kv: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout on the full sequence (float64), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, SEQ, h, DIM) for h in (HEADS, kv, kv, HEADS)]
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)


def rank_cases(rank: int, world: int) -> list[dict]:
    """Every case's output and gradients on this rank (float32), and the step clock's
    communication bytes of one case."""
    results = []
    for i, (kernel, params, layout, causal, kv) in enumerate(cases(world)):
        full = inputs(i, kv)
        q, k, v, dout = (layouts.shard(t.float(), layout, rank, world) for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        clock.start(q.device)
        comm.traffic.reset()
        module = attention.build(kernel, **params)
        out = module(q, k, v, causal=causal)
        out.backward(dout)
        steps = clock.collect()
        clock.stop()
        results.append(
            {
                "out": out.detach(),
                "dq": q.grad,
                "dk": k.grad,
                "dv": v.grad,
                "sent": comm.traffic.sent,
                "wait_bytes": sum(s["sent_bytes"] for s in steps),
                "plan": module.plan,
            }
        )
    return results


def reference(kernel: str, params: dict, causal: bool, seed: int, kv: int) -> dict:
    """The float64 reference's output and gradients on the full sequence."""
    from workers.references import REFERENCE_DTYPE, reference_for  # not in the rank processes

    inner = dict(params)
    name = inner.pop("inner", "dense") if kernel == "ulysses" else "dense"
    ref = reference_for(name, {} if kernel != "ulysses" else inner)
    q, k, v, dout = inputs(seed, kv)
    q, k, v = (t.to(REFERENCE_DTYPE).requires_grad_() for t in (q, k, v))
    out = ref(q, k, v, causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_schemes_equal_the_float64_reference(world):
    per_rank = run_ranks(rank_cases, world)
    for i, (kernel, params, layout, causal, kv) in enumerate(cases(world)):
        ref = reference(kernel, params, causal, i, kv)
        for name in ("out", "dq", "dk", "dv"):
            got = layouts.unshard([r[i][name] for r in per_rank], layout)
            torch.testing.assert_close(
                got.double(),
                ref[name],
                atol=2e-5,
                rtol=2e-5,
                msg=lambda m, n=name, c=(kernel, params, causal, kv): f"{n} {c}: {m}",
            )
        for r in per_rank:  # every byte moved is counted, and in a clock step
            assert r[i]["sent"] == r[i]["wait_bytes"]
            assert (r[i]["sent"] > 0) == (world > 1)
            # ulysses over dilated or block_sparse reports the plan its inner kernel ran
            assert r[i]["plan"] == ("cpu" if params.get("inner") in PLANNED else None)


def test_invalid_params_are_one_clear_error_naming_the_field():
    from attention.ring.ulysses import check_heads

    bad = [
        (lambda: attention.build("ulysses", inner="flash"), r"params.inner: must be one of"),
        (
            lambda: attention.build("ulysses", segment_lengths=[4]),
            r"params.segment_lengths: not a parameter of inner kernel 'dense'",
        ),
        (
            lambda: attention.build("ulysses", inner="dilated", dilation_rates=[1, 2]),
            r"params.dilation_rates: must have one rate per segment length",
        ),
        (
            lambda: attention.validate("ulysses", {}, seq_len=32, world_size=4, num_heads=6),
            r"num_heads: 6 must be divisible by world_size 4",
        ),
        (lambda: check_heads(8, 3, 2, "world_size"), r"num_kv_heads: 3 must be divisible by"),
        (
            lambda: attention.validate("usp", {"ulysses_degree": 3}, seq_len=48, world_size=4),
            r"params.ulysses_degree: 3 must divide world_size 4",
        ),
        (lambda: attention.build("usp", ulysses_degree=0), r"params.ulysses_degree: must be"),
        (
            lambda: attention.build("allgather_kv", layout="striped"),
            r"params.layout: must be one of contiguous, zigzag",
        ),
        (
            lambda: attention.validate("allgather_kv", {}, seq_len=12, world_size=4),
            r"seq_len: 12 must be divisible by 2 x world_size = 8",
        ),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()
    check_heads(8, 1, 4, "world_size")  # one kv head, replicated to 4 head groups
    sparse = {"inner": "block_sparse", "block_size": 4, "window": 2}
    attention.validate("ulysses", sparse, seq_len=32, world_size=2, num_heads=4)
