"""Grouped- and multi-query attention (k, v with num_kv_heads < num_heads) in every kernel.

Single-process kernels against PyTorch's SDPA with enable_gqa (dense and block_sparse, whose
token mask SDPA takes) or the fp64 masked reference (dilated, whose branches SDPA cannot mix),
forward and gradients; ring kernels in gloo processes against their twins; a ring step moves
num_kv_heads / num_heads of the bytes; the run config refuses heads that do not divide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist_helpers import run_ranks

import attention
from attention import layouts
from attention.masks import block_token_mask, dilated_reference
from attention.ring import comm

pytestmark = pytest.mark.timeout(120)

HEADS, SEQ, DIM = 6, 30, 8
KV_HEADS = [1, 2, 3]  # multi-query, groups of 3 (r = 4 head groups straddle them), of 2


def _inputs(kv_heads: int, seed: int = 0, seq: int = SEQ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, seq, HEADS, DIM), (2, seq, kv_heads, DIM), (2, seq, kv_heads, DIM)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in (*shapes, shapes[0])]


def _check(module, reference, kv_heads: int, causal: bool, seq: int = SEQ) -> None:
    """fp32 kernel vs fp64 reference: out and dq, dk, dv (dk, dv with kv_heads heads)."""
    q64, k64, v64, dout = _inputs(kv_heads, seq=seq)
    q64, k64, v64 = (t.requires_grad_() for t in (q64, k64, v64))
    q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
    out = module(q, k, v, causal=causal)
    ref = reference(q64, k64, v64, causal)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out, (q, k, v), dout.float())
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout)
    for name, a, b in zip("qkv", grads, refs, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=f"d{name}")


def _sdpa(keep: torch.Tensor | None):
    def reference(q, k, v, causal):
        mask = None if keep is None else keep
        out = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)),
            attn_mask=mask,
            is_causal=causal and keep is None,
            enable_gqa=True,
        )
        return out.transpose(1, 2)

    return reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_dense_matches_sdpa_enable_gqa(kv_heads, causal) -> None:
    _check(attention.build("dense"), _sdpa(None), kv_heads, causal)


@pytest.fixture(params=["whole", "split"])
def head_calls(request, monkeypatch) -> None:
    """Calls on all heads at once, or cut to one or two query heads a call (as long rows are;
    dilated's backward also in parts of 3 queries and 2 keys)."""
    if request.param == "split":
        from attention import dilated
        from attention.block_sparse import backward as block_sparse_backward

        monkeypatch.setattr(dilated, "CALL_ROW_HEADS", 2 * SEQ)
        monkeypatch.setattr(dilated, "BACKWARD_ROW_HEADS", 1)
        monkeypatch.setattr(dilated, "BACKWARD_QUERY_TOKENS", 3)
        monkeypatch.setattr(dilated, "BACKWARD_KEY_TOKENS", 2)
        monkeypatch.setattr(block_sparse_backward, "CALL_ROW_HEADS", 1)


@pytest.mark.usefixtures("head_calls")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize(
    "params",
    [
        {"block_size": 4, "pattern": "local_window", "window": 1},
        {"block_size": 4, "pattern": "random", "num_random": 2, "seed": 3},  # gathered rows
        # the cuda plan's global strips and masked boxes
        {"block_size": 4, "pattern": "global_local", "window": 3, "num_global": 4},
    ],
    ids=lambda p: p["pattern"],
)
@pytest.mark.parametrize("plan", ["cpu", "cuda"])
def test_block_sparse_matches_sdpa_enable_gqa(params, kv_heads, causal, plan) -> None:
    module = attention.build("block_sparse", plan=plan, **params)
    keep = block_token_mask(module.block_mask(SEQ), 4, causal=causal, seq_len=SEQ)
    _check(module, _sdpa(keep), kv_heads, causal)


@pytest.mark.usefixtures("head_calls")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("plan", ["cpu", "cuda"])
def test_dilated_matches_the_masked_reference(plan, kv_heads, causal) -> None:
    ws, rs = (4, 8, 16, 64), (1, 2, 4, 6)  # r = 4: head groups of 2 across kv groups of 3

    def reference(q, k, v, causal):
        return dilated_reference(q, k, v, ws, rs, causal=causal)

    _check(
        attention.build("dilated", segment_lengths=ws, dilation_rates=rs, plan=plan),
        reference,
        kv_heads,
        causal,
    )


def test_kv_head_pieces_map_each_query_head_to_its_kv_head() -> None:
    from attention.primitive import kv_head_pieces

    for kv in (1, 2, 3, 6):
        for h0, h1 in [(0, 6), (1, 5), (2, 4), (3, 6)]:
            for cap in (None, 1, 2, 3, 4, 6):
                pieces = kv_head_pieces(h0, h1, 6, kv, cap)
                heads = [h for a0, a1, _, _ in pieces for h in range(a0, a1)]
                assert heads == list(range(h0, h1)), (kv, h0, h1, cap, pieces)
                for a0, a1, c0, c1 in pieces:
                    assert (a1 - a0) % (c1 - c0) == 0
                    per = (a1 - a0) // (c1 - c0)  # the primitive's mapping inside the call
                    assert all((a0 + i) // (6 // kv) == c0 + i // per for i in range(a1 - a0))
                    assert cap is None or a1 - a0 <= max(cap, 6 // kv if c1 - c0 > 1 else cap)


@pytest.mark.parametrize("kv_heads", [2])
def test_the_layer_projects_k_and_v_to_its_kv_heads(kv_heads) -> None:
    layer = attention.build(
        "multihead", embed_dim=HEADS * DIM, num_heads=HEADS, num_kv_heads=kv_heads
    )
    assert layer.k_proj.weight.shape == (kv_heads * DIM, HEADS * DIM)
    from workers.references import layer_reference

    x = torch.randn(1, SEQ, HEADS * DIM)
    x64 = x.double()  # the reference runs in float64 (references.REFERENCE_DTYPE)
    torch.testing.assert_close(
        layer(x).double(), layer_reference(layer)(x64, x64, x64, False), atol=1e-5, rtol=1e-5
    )
    full = attention.build("multihead", embed_dim=HEADS * DIM, num_heads=HEADS)
    saved = 2 * 2 * 1 * SEQ * HEADS * DIM * (HEADS - kv_heads) * DIM  # k, v projections shrink
    assert full.flops(1, SEQ, HEADS, DIM) - layer.flops(1, SEQ, HEADS, DIM) == saved


RING_KERNELS = [
    ("ring", {"layout": "contiguous"}),
    ("ring", {"layout": "zigzag"}),
    ("ring", {"layout": "striped"}),
    ("ring_dilated", {"segment_lengths": [8, 32, 64], "dilation_rates": [1, 4, 6]}),
    ("ring_dilated", {"segment_lengths": [8, 32], "dilation_rates": [1, 2], "layout": "zigzag"}),
    ("ring_dilated", {"segment_lengths": [16, 64], "dilation_rates": [2, 4], "layout": "striped"}),
    ("ring_block_sparse", {"block_size": 4, "pattern": "local_window", "window": 2}),
    (
        "ring_block_sparse",
        {"block_size": 4, "pattern": "random", "num_random": 3, "layout": "striped"},
    ),
]
"""Every layout: ring's three, ring_dilated's and ring_block_sparse's default (contiguous, or
zigzag when causal), zigzag and striped."""
RING_SEQ = 64


def _twin(kernel: str, params: dict):
    twin = {"ring": "dense", "ring_dilated": "dilated", "ring_block_sparse": "block_sparse"}[kernel]
    keep = {"ring": set(), "ring_dilated": {"segment_lengths", "dilation_rates"}}
    names = keep.get(kernel, set(params) - {"layout"})
    return attention.build(twin, **{k: v for k, v in params.items() if k in names})


def rank_gqa(rank: int, world: int) -> list[dict]:
    results = []
    for i, (kernel, params) in enumerate(RING_KERNELS):
        for kv_heads in (2, HEADS):
            for causal in (False, True):
                module = attention.build(kernel, **params)
                pos = module.local_positions(RING_SEQ, rank, world, causal=causal)
                full = [t.float() for t in _inputs(kv_heads, seed=i, seq=RING_SEQ)]
                q, k, v, dout = (t[:, pos].clone() for t in full)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                comm.traffic.reset()
                out = module(q, k, v, causal=causal)
                sent = comm.traffic.sent
                out.backward(dout)
                results.append(
                    {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "sent": sent}
                )
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ring_kernels_with_gqa_equal_their_twins_and_move_fewer_bytes(world) -> None:
    per_rank = run_ranks(rank_gqa, world)
    index = 0
    for i, (kernel, params) in enumerate(RING_KERNELS):
        sent = {}
        for kv_heads in (2, HEADS):
            for causal in (False, True):
                full = [t.float() for t in _inputs(kv_heads, seed=i, seq=RING_SEQ)]
                q, k, v = (t.clone().requires_grad_() for t in full[:3])
                out = _twin(kernel, params)(q, k, v, causal=causal)
                out.backward(full[3])
                ref = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
                module = attention.build(kernel, **params)
                for name in ref:
                    parts = [r[index][name] for r in per_rank]
                    layout = getattr(module, "layout", None) or (
                        "zigzag" if causal else "contiguous"
                    )
                    if kernel == "ring_dilated":
                        layout = params.get("layout", "contiguous")
                    got = layouts.unshard(parts, layout)
                    torch.testing.assert_close(
                        got,
                        ref[name],
                        atol=1e-5,
                        rtol=1e-5,
                        msg=f"{kernel} {params} {kv_heads} {causal} {name}",
                    )
                sent[kv_heads, causal] = sum(r[index]["sent"] for r in per_rank)
                index += 1
        for causal in (False, True):
            if kernel == "ring_dilated":  # a head group gathers only its kv head's rows
                assert sent[2, causal] <= sent[HEADS, causal], (params, sent)
            else:  # K/V travel the ring with their own heads: 2 of 6 of the bytes
                assert sent[HEADS, causal] > 0
                assert sent[2, causal] * HEADS == sent[HEADS, causal] * 2, (kernel, params, sent)


def test_a_run_refuses_kv_heads_that_do_not_divide_the_heads() -> None:
    from workers.config import RunConfig

    base = {"kernel": "dense", "seq_len": 64, "num_heads": 6}
    assert RunConfig.model_validate({**base, "num_kv_heads": 2}).kv_heads == 2
    assert RunConfig.model_validate(base).kv_heads == 6
    with pytest.raises(
        ValueError, match=r"num_kv_heads: 4 key/value heads must divide num_heads \(6\)"
    ):
        RunConfig.model_validate({**base, "num_kv_heads": 4})


def test_the_api_names_num_kv_heads_and_stores_nothing(tmp_path) -> None:
    """A sweep whose num_kv_heads does not divide num_heads is a 422 at base.num_kv_heads (or at
    the grid value); one that divides runs k, v with that many heads."""
    from _api_helpers import api_client

    base = {"kernel": "dense", "seq_len": 64, "num_heads": 8, "device": "cpu"}
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post("/api/v1/sweeps", json={"name": "g", "base": {**base, "num_kv_heads": 3}})
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"][:3] == ["body", "base", "num_kv_heads"], err
        assert "must divide num_heads (8)" in err["msg"]
        spec = {"name": "g", "base": base, "grid": {"num_kv_heads": [1, 2, 5]}}
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422, r.text
        assert [e["loc"][:3] for e in r.json()["detail"]] == [["body", "grid", "num_kv_heads"]]
        assert client.get("/api/v1/sweeps").json()["count"] == 0
        spec["grid"] = {"num_kv_heads": [1, 2, 8]}
        assert client.post("/api/v1/sweeps", json=spec).status_code == 201
