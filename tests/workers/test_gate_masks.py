"""The correctness gate under a run's `mask`: the reference is the fp64 attention of that mask's
exact predicate (attention.mask.parse(mask).keep), for dense and for the sharded kernels
checked through their twin; a kernel that attends under another mask fails it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_helpers import run_ranks
from _workers_helpers import config

import attention
from attention import layouts
from attention.mask import expand, parse
from attention.masks import masked_attention
from workers import gate, protocol, references
from workers.config import RunConfig
from workers.gate import CHECK_ATOL

CPU = torch.device("cpu")
S = 512
SAMPLED = {
    "distribution": "lognormal",
    "mean": 96,
    "max_fraction": 0.25,
    "seed": 0,
    "multiple_of": 4,
}
DOCS = expand({"kind": "documents", "causal": True, "sampled": SAMPLED}, S)
OTHER = {"kind": "documents", "causal": True, "lengths": [S // 2, S // 2]}


def test_the_dense_reference_is_the_masks_exact_predicate() -> None:
    """reference_for(dense, mask) equals einsum attention under parse(mask).dense(S), and the
    sharded kernels (ring with a balance, allgather_kv, usp; ulysses through its inner dense)
    are checked against the very same one."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = masked_attention(q, k, v, parse(DOCS, S).dense(S))[0]
    got = references.reference_for("dense", {"mask": DOCS})(q, k, v, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = references.reference_for("dense", {})(q, k, v, True)
    assert (plain - want).abs().max() > 0.1  # the mask matters on these inputs
    for kernel, params in [
        ("ring", {"mask": DOCS, "balance": "per_document"}),
        ("allgather_kv", {"mask": DOCS, "balance": "ptrr"}),
        ("usp", {"mask": DOCS, "balance": "head_tail", "ulysses_degree": 2}),
        ("ulysses", {"mask": DOCS}),
    ]:
        sharded = references.reference_for(kernel, params)(q, k, v, True)
        torch.testing.assert_close(sharded, want, rtol=0, atol=0, msg=kernel)


def test_the_masked_reference_refuses_a_call_that_contradicts_its_mask() -> None:
    q = torch.zeros(1, S, 1, 4, dtype=torch.float64)
    reference = references.reference_for("dense", {"mask": DOCS})
    with pytest.raises(ValueError, match="causal"):
        reference(q, q, q, False)


def test_describe_names_the_mask() -> None:
    assert "documents" in references.describe("dense", {"mask": DOCS})


def test_dense_under_a_mask_passes_the_gate_and_a_kernel_ignoring_it_fails() -> None:
    cfg = config(params={"mask": DOCS}, causal=True, mode="train", seq_len=S)
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    assert 0 < case.result.max_abs_error <= CHECK_ATOL["float32"]
    reference = references.reference_for("dense", {"mask": DOCS})
    unmasked = attention.build("dense")  # plain causal: the mask silently dropped
    assert gate.max_error(cfg, unmasked, reference, 0, CPU) > 100 * CHECK_ATOL["float32"]


def _under_docs(kernel: str, balance: str | None, world: int, **fields: Any) -> RunConfig:
    """A causal run of `kernel` on S tokens and `world` ranks under DOCS with `balance`, with
    `fields` on top."""
    params = {"mask": DOCS, "balance": balance}
    return config(kernel=kernel, params=params, seq_len=S, world_size=world, causal=True, **fields)


def rank_ring_gate(rank: int, world: int, balance: str) -> dict[str, Any]:
    """This rank's gated ring run under DOCS with `balance` (W=2, gloo), and the error of the
    same ring kernel against the reference of OTHER (a kernel wrong for its mask)."""
    cfg = _under_docs("ring", balance, world, mode="train")
    case = protocol.run_case(cfg, rank)
    module = attention.build("ring", mask=DOCS, balance=balance)
    other = references.reference_for("dense", {"mask": OTHER})
    wrong = gate.max_error(cfg, module, other, rank, CPU)
    error = None if case.result is None else case.result.max_abs_error
    return {"status": case.status, "error": error, "message": case.error, "wrong": wrong}


@pytest.mark.parametrize("balance", ["per_document", "ptrr"])
def test_a_ring_under_a_documents_mask_and_a_balance_passes_the_gate(balance: str) -> None:
    for found in run_ranks(rank_ring_gate, 2, balance):
        assert found["status"] == "ok", found["message"]
        assert 0 < found["error"] <= CHECK_ATOL["float32"]
        assert found["wrong"] > 100 * CHECK_ATOL["float32"]


def rank_kept_pairs(rank: int, world: int, kernel: str, balance: str | None) -> int | None:
    """The kept_pairs this rank's RankResult stores for `kernel` under DOCS with `balance`."""
    cfg = _under_docs(kernel, balance, world, correctness_check=False)
    case = protocol.run_case(cfg, rank)
    assert case.status == "ok", case.error
    return case.result.kept_pairs


@pytest.mark.parametrize(
    ("kernel", "balance"), [("ring", "none"), ("ring", "per_document"), ("allgather_kv", "ptrr")]
)
def test_each_rank_stores_the_pairs_its_order_gives_it(kernel: str, balance: str) -> None:
    """kept_pairs of each rank: the kept pairs of the queries the balance's order puts on it
    (attention.layouts.rank_pairs, from the mask's row counts), times the heads."""
    heads = config().num_heads
    got = run_ranks(rank_kept_pairs, 2, kernel, balance)
    order = layouts.order(balance, S, 2, parse(DOCS, S))
    want = (heads * layouts.rank_pairs(DOCS, order, 2)).tolist()
    assert got == want
    assert sum(got) == heads * parse(DOCS, S).pairs(S)
    assert layouts.imbalance(torch.tensor(got)) >= 1.0


def test_a_kernel_without_pairs_per_rank_stores_none() -> None:
    assert protocol.run_case(config(params={"mask": DOCS}, causal=True)).result.kept_pairs is None


def test_a_half_precision_tolerance_is_dense_sdpas_own_error_under_the_same_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In bfloat16 the tolerance derives from dense SDPA's error under the run's mask (not
    full causal attention's), a chunk of rows at a time: the chunks give the same error."""
    cfg = config(
        params={"mask": DOCS}, causal=True, mode="train", seq_len=S, dtype="bfloat16",
        num_heads=4, head_dim=32,
    )  # fmt: skip
    result = gate.run_gate(cfg, 0, CPU, "correctness")
    assert result.passed("bfloat16"), result.summary()
    masked = result.full_dense_error
    unmasked = gate.dense_error(cfg.model_copy(update={"params": {}}), 0, CPU, None)
    assert masked is not None and masked != unmasked
    monkeypatch.setattr(gate, "CHUNK_BYTES", 8 * 4 * S * 7)  # 7 rows a chunk
    assert gate.dense_error(cfg, 0, CPU, None) == pytest.approx(masked, rel=1e-6)
    rows = gate.sample_rows(cfg, S)
    assert 0 < gate.dense_error(cfg, 0, CPU, rows) <= masked
