"""Packed variable-length batches (`document_lengths`): dense and ring against einsum attention
under the block-diagonal document mask, output and gradients, for W in {1, 2, 4}; FLOPs count
only the pairs inside documents; bad lengths are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _api_helpers import api_client
from _dist_helpers import run_ranks

import attention
from attention import layouts
from attention.documents import document_mask
from attention.masks import masked_attention
from attention.ring import engine

pytestmark = pytest.mark.timeout(120)

LENGTHS = (10, 30, 7, 1, 48)  # 96 tokens; documents cross the shard boundaries at W = 2, 4
SHAPE = (2, 96, 4, 8)  # batch, seq, heads, head_dim; k and v have 2 heads (grouped-query)


def inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = SHAPE
    q, dout = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)
    k, v = torch.randn(b, s, 2, d, generator=g), torch.randn(b, s, 2, d, generator=g)
    return q, k, v, dout


def reference(causal: bool) -> dict[str, torch.Tensor]:
    q, k, v, dout = inputs()
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = masked_attention(q, k, v, document_mask(LENGTHS, causal))[0]
    out.backward(dout.double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def ring_rank(rank: int, world: int, causal: bool) -> dict[str, torch.Tensor]:
    engine.PIECE_TOKENS = 8  # several K/V pieces per shard
    q, k, v, dout = (layouts.shard(t, "contiguous", rank, world) for t in inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    module = attention.build("ring", layout="contiguous", document_lengths=list(LENGTHS))
    out = module(q, k, v, causal=causal)
    out.backward(dout)
    flops = module.flops(SHAPE[0], q.shape[1], SHAPE[2], SHAPE[3], causal)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "flops": flops}


@pytest.mark.parametrize("causal", [False, True])
def test_dense_packs_documents(causal: bool) -> None:
    ref = reference(causal)
    q, k, v, dout = inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    module = attention.build("dense", document_lengths=list(LENGTHS))
    out = module(q, k, v, causal=causal)
    out.backward(dout)
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, value in got.items():
        torch.testing.assert_close(value.double(), ref[name], atol=1e-5, rtol=1e-5, msg=name)
    keep = document_mask(LENGTHS, causal)
    pairs = int(keep.sum()) * SHAPE[0] * SHAPE[2]
    assert module.flops(SHAPE[0], 96, SHAPE[2], SHAPE[3], causal) == 4 * pairs * SHAPE[3]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_packs_documents(world: int, causal: bool) -> None:
    ref = reference(causal)
    ranks = run_ranks(ring_rank, world, causal)
    for name in ("out", "dq", "dk", "dv"):
        got = torch.cat([r[name] for r in ranks], dim=1)  # contiguous shards, in rank order
        torch.testing.assert_close(got.double(), ref[name], atol=1e-5, rtol=1e-5, msg=name)
    dense = attention.build("dense", document_lengths=list(LENGTHS))
    assert sum(r["flops"] for r in ranks) == dense.flops(SHAPE[0], 96, SHAPE[2], SHAPE[3], causal)


def test_bad_document_lengths_are_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(attention.ParamError) as short:
        attention.validate("dense", {"document_lengths": [10, 20]}, seq_len=96)
    assert short.value.path == ("params", "document_lengths") and "sum to 30" in str(short.value)
    with pytest.raises(attention.ParamError) as zigzag:  # causal rings default to zigzag
        attention.validate("ring", {"document_lengths": [48, 48]}, seq_len=96, world_size=2,
                           causal=True)  # fmt: skip
    assert zigzag.value.path == ("params", "layout")
    spec = {"name": "packed", "base": {"kernel": "dense", "device": "cpu", "seq_len": 96},
            "grid": {"params.document_lengths": [[48, 48], [48, 0, 48]]}}  # fmt: skip
    with api_client(f"sqlite:///{tmp_path / 'd.db'}") as client:
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422
        (error,) = r.json()["detail"]
        assert error["loc"][-2:] == ["params.document_lengths", 1]  # the grid value
        assert ">= 1" in error["msg"]


def test_a_packed_run_passes_the_gate_at_its_full_length_and_counts_its_pairs() -> None:
    from _workers_helpers import config

    from workers import protocol

    cfg = config(params={"document_lengths": [100, 412]}, causal=True, mode="train",
                 correctness_check=True)  # fmt: skip
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    assert case.result.check_seq_len == 512  # a shorter length would not hold the documents
    assert case.result.max_abs_error <= 1e-4
    pairs = (100 * 101 // 2 + 412 * 413 // 2) * cfg.batch_size * cfg.num_heads
    assert case.result.flops == attention.attention_flops(pairs, cfg.head_dim, backward=True)


def test_a_search_cannot_vary_the_length_of_packed_documents() -> None:
    from pydantic import ValidationError

    from workers.config import RunConfig

    with pytest.raises(ValidationError, match="packed documents fix the sequence length"):
        RunConfig(kernel="dense", seq_len=96, params={"document_lengths": [48, 48]},
                  search={"start": 96})  # fmt: skip
