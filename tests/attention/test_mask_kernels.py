"""Masks on the single-process side: `dense` under every mask kind equals the fp64 reference from
the explicit mask (forward and gradients, GQA, several accumulator windows); the mask plan keeps
exactly the mask's pairs on every rank and leaves a step without kept pairs empty; a mask or
balance a kernel does not take is refused, naming it and the kernel."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _mask_cases import LENGTHS, MASKS, S, inputs, mask_id, reference

import attention
from attention import KERNELS, layouts
from attention.errors import ParamError
from attention.mask import KINDS, expand, from_legacy, parse
from attention.mask.table import with_table
from attention.ring import mask_plan as mask_plan_module
from attention.ring.dense import RingParams, token_order
from attention.ring.mask_plan import mask_plan

pytestmark = pytest.mark.timeout(120)

WIDE = [
    {"kind": "sliding_window", "causal": True, "window": 150},
    {"kind": "documents", "causal": False, "lengths": LENGTHS, "window": 90},
]
"""Windows wider than the tests' masked chunks (MASK_ROWS 32): chunks with a fused middle
between edges; the narrower ones too (window 40, 24)."""


@pytest.mark.parametrize("mask", MASKS + WIDE, ids=mask_id)
def test_dense_is_exact_under_every_mask(
    mask: dict[str, Any], accumulator_windows, monkeypatch: pytest.MonkeyPatch
) -> None:
    accumulator_windows(3)  # several row windows: the plan's rows re-based per window
    monkeypatch.setattr(mask_plan_module, "MASK_ROWS", 32)  # chunks with a fused middle
    ref = reference(mask, seed=7)
    q, k, v, dout = inputs(7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention.build("dense", mask=mask)(q, k, v, causal=parse(mask).causal)
    out.backward(dout)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, atol=1e-10, rtol=1e-9, msg=name)


def test_dense_flops_count_the_masks_pairs() -> None:
    mask = MASKS[2]
    module = attention.build("dense", mask=mask)
    assert module.flops(1, S, 1, 8) == attention.attention_flops(parse(mask).pairs(S), 8)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("balance", [None, *layouts.BALANCES])
@pytest.mark.parametrize("mask", MASKS + WIDE, ids=mask_id)
def test_mask_plan_keeps_exactly_the_masks_pairs(
    mask: dict[str, Any], balance: str | None, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mask_plan_module, "MASK_ROWS", 32)  # chunks with a fused middle
    if balance == "per_document" and mask["kind"] != "documents":
        pytest.skip("per_document balances documents")
    parsed = parse(mask)
    order = token_order(RingParams(mask=mask, balance=balance), S, world, parsed.causal)
    shard = layouts.shard_pairs(parsed, order, world)
    n = S // world
    for rank in range(world):
        plan = mask_plan(parsed, order, rank, world)
        for t, blocks in enumerate(plan):
            src = (rank - t) % world
            assert sum(b.pairs() for b in blocks) == int(shard[rank, src])
            assert (not blocks) == (shard[rank, src] == 0)  # nothing kept: nothing computed
            covered = torch.zeros(n, n, dtype=torch.int64)
            for b in blocks:
                keep = b.keep()
                if keep is None:
                    keep = torch.ones(b.q1 - b.q0, b.k1 - b.k0, dtype=torch.bool)
                    keep = keep.tril() if b.causal else keep
                covered[b.q0 : b.q1, b.k0 : b.k1] += keep.long()
            mine, held = order[rank * n : (rank + 1) * n], order[src * n : (src + 1) * n]
            want = parsed.keep(mine[:, None], held[None, :]).long()
            assert torch.equal(covered, want), f"rank {rank} step {t}"


def test_a_causal_mask_plans_fused_blocks_only() -> None:
    """Causal on zigzag shards: rectangles and causal squares, no masked block."""
    order = token_order(RingParams(mask={"kind": "causal"}, balance="ptrr"), S, 4, True)
    plans = [mask_plan(parse({"kind": "causal"}), order, r, 4) for r in range(4)]
    assert all(b.mask is None for plan in plans for step in plan for b in step)


def test_kernels_declare_what_they_take() -> None:
    assert KERNELS["dense"].masks == KERNELS["ring"].masks == frozenset(KINDS)
    assert KERNELS["ring"].balances == frozenset(layouts.BALANCES)
    assert KERNELS["dense"].balances == frozenset()
    assert KERNELS["ring_dilated"].masks == frozenset({"full", "causal"})


@pytest.mark.parametrize(
    ("kernel", "params", "path", "words"),
    [
        ("dense", {"balance": "ptrr"}, "params.balance", "kernel 'dense'"),
        ("ring_dilated", {"mask": {"kind": "causal"}}, "params.mask", "kernel 'ring_dilated'"),
        ("ring", {"balance": "zigzag"}, "balance", "kernel 'ring' takes the balances"),
        ("ring", {"balance": "ptrr", "layout": "zigzag"}, "params.layout", "leave layout unset"),
        ("ring", {"mask": {"kind": "nope"}}, "mask.kind", "must be one of"),
        ("ulysses", {"balance": "ptrr"}, "balance", "kernel 'ulysses' takes no balance"),
        (
            "ulysses",
            {"inner": "dilated", "mask": MASKS[5]},
            "mask",
            "inner kernel 'dilated', which takes the masks causal, full, not documents",
        ),
        ("allgather_kv", {"balance": "none", "layout": "zigzag"}, "params.layout", "unset"),
        (
            "dense",
            {"mask": {"kind": "causal"}, "document_lengths": [4]},
            "params.document_lengths",
            "not both",
        ),
    ],
)
def test_masks_and_balances_a_kernel_does_not_take_are_refused(
    kernel: str, params: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(ParamError) as caught:
        attention.build(kernel, **params)
    assert ".".join(caught.value.path) == path and words in str(caught.value)


def test_a_call_contradicting_its_mask_is_refused() -> None:
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ParamError, match="causal=False"):
        attention.build("dense", mask={"kind": "causal"})(q, q, q, causal=False)


def test_striped_shards_refuse_a_general_mask() -> None:
    params = RingParams(mask=MASKS[2], layout="striped")
    with pytest.raises(ParamError, match="striped"):
        token_order(params, S, 2, True)


def test_the_legacy_spelling_means_the_same_mask() -> None:
    """causal + document_lengths and the mask from_legacy gives compute the same attention."""
    q, k, v, _ = inputs(3)
    old = attention.build("dense", document_lengths=LENGTHS)(q, k, v, causal=True)
    mask = from_legacy(True, LENGTHS)
    new = attention.build("dense", mask=mask)(q, k, v, causal=True)
    torch.testing.assert_close(new, old, atol=1e-10, rtol=1e-9)


def test_ulysses_passes_a_full_or_causal_mask_to_any_inner_kernel_as_its_flag() -> None:
    module = attention.build("ulysses", inner="dilated", mask={"kind": "causal"})
    assert module.params.inner_params() == {}  # dilated has no `mask`: causal=True says it
    assert attention.build("ulysses", mask=MASKS[2]).params.inner_params()["mask"] == MASKS[2]


@pytest.mark.parametrize("kernel", ["dense", "ring", "allgather_kv", "ulysses", "usp"])
def test_params_hold_the_mask_as_the_dict_a_run_stores(kernel: str) -> None:
    """Params stay plain data (stored as JSON): the mask as parse(mask).to_dict()."""
    sampled = {"distribution": "uniform", "mean": 64, "max_fraction": 0.5, "seed": 1}
    stored = expand({"kind": "documents", "causal": True, "sampled": sampled}, S)
    params = attention.make_params(kernel, {"mask": stored})
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    assert fields["mask"] == stored
    json.dumps({k: v for k, v in fields.items() if k != "group"})


def test_the_docs_kernel_table_is_the_declarations() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "masks.md").read_text()
    assert with_table(doc) == doc, "run attention.mask.table.with_table on docs/masks.md"
    assert "| `ring` | yes | yes | yes | yes | yes | head_tail, none, per_document, ptrr |" in doc


def test_a_wide_window_computes_only_its_edges_under_the_predicate() -> None:
    """Masked blocks hold the window's two edges, not the window: their pairs are a small
    share of the plan's."""
    seq_len = 4096
    mask = parse({"kind": "sliding_window", "causal": True, "window": 1024})
    blocks = mask_plan(mask, torch.arange(seq_len), 0, 1)[0]
    masked = [b for b in blocks if b.mask is not None]
    computed = sum((b.q1 - b.q0) * (b.k1 - b.k0) for b in masked)
    assert masked and any(b.mask is None and not b.causal for b in blocks)
    assert computed < 0.3 * mask.pairs(seq_len)


@pytest.mark.parametrize("kernel", ["ring", "allgather_kv", "usp"])
@pytest.mark.parametrize("balance", [None, "ptrr"])
def test_sharded_kernels_count_exactly_the_masks_pairs(kernel: str, balance: str | None) -> None:
    """rank_pairs (their FLOPs) summed over the ranks: every kept pair once, per head."""
    world, heads, mask = 4, 4, MASKS[7]
    module = attention.build(kernel, mask=mask, balance=balance)
    per_rank = [module.rank_pairs(S // world, heads, True, r, world) for r in range(world)]
    assert sum(per_rank) == heads * parse(mask).pairs(S)


@pytest.mark.parametrize("mask", [MASKS[3], MASKS[7]], ids=mask_id)
def test_dense_under_a_mask_in_bf16_stays_near_the_reference(mask: dict[str, Any]) -> None:
    """bf16 runs the masked tiles' fused op in bf16 (its additive mask too): bf16 accuracy."""
    ref = reference(mask, seed=5)
    q, k, v, dout = (t.bfloat16() for t in inputs(5))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention.build("dense", mask=mask)(q, k, v, causal=parse(mask).causal)
    out.backward(dout)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, want in ref.items():
        torch.testing.assert_close(got[name].double(), want, atol=5e-2, rtol=5e-2, msg=name)


def test_a_balance_without_a_mask_weighs_the_older_spelling() -> None:
    """balance with causal + document_lengths: the order of the mask from_legacy gives."""
    legacy = RingParams(balance="per_document", document_lengths=tuple(LENGTHS))
    mask = from_legacy(True, LENGTHS)
    want = layouts.order("per_document", S, 4, mask)
    assert torch.equal(token_order(legacy, S, 4, True), want)
    plain = RingParams(balance="head_tail")
    assert torch.equal(token_order(plain, S, 4, True), layouts.order("head_tail", S, 4, mask))
