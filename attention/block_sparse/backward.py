"""block_sparse's backward under the CPU plan: each call of _backward_plan run with the merged
(out, lse), its query tokens and heads bounded so its temporaries stay small (_backward_split)."""

from __future__ import annotations

import itertools

import torch

from attention import primitive
from attention.block_sparse.cpu_plan import (
    _backward_plan,
    _Call,
    _call_diagonal,
    _chunks,
    _gather,
    _rel_keys,
    _row_views,
    _token_index,
)
from attention.block_sparse.forward import SUPERBLOCK_TOKENS
from attention.block_sparse.params import BlockSparseParams
from attention.primitive import block_backward, zero_grads

CALL_ROW_HEADS = 6144
"""Bound on rows x heads of one backward call's temporaries (see _backward_split)."""
BACKWARD_KEY_TOKENS = 512
"""Bound on the key tokens of one backward call (see _key_parts)."""
BACKWARD_QUERY_TOKENS = 512
"""Bound on the query tokens of one backward call: the CPU flash op's backward takes a buffer
of 1 MiB per thread from 768 queries, 256 KiB below (FlashAttentionKernel.cpp)."""


def _backward_split(call: _Call, bs: int, heads: int) -> tuple[int, int]:
    """(query tokens, query heads) of one backward call of `call`: its temporaries (per query
    token its dq and the op's contiguous copy of dout, per key token its dk and dv; a rel
    call's rows each have their own keys) stay within CALL_ROW_HEADS rows x heads, and its
    query tokens within BACKWARD_QUERY_TOKENS (a rel call's: whole blocks, at least one).
    Heads go in powers of two, as many as fit: the op runs them in parallel."""
    rel = call.kind == "rel"
    fixed = 0 if rel else 2 * call.key_blocks * bs
    per_token = 2 + 2 * call.key_blocks if rel else 2
    unit = bs if rel else 1
    fit = max(1, min(heads, CALL_ROW_HEADS // (fixed + per_token * unit)))
    max_heads = 1 << (fit.bit_length() - 1)
    if fixed + per_token * unit > CALL_ROW_HEADS:  # one block of keys alone is over it:
        tokens = BACKWARD_QUERY_TOKENS  # fewer queries cannot make it fit, only slower
    else:
        tokens = (CALL_ROW_HEADS // max_heads - fixed) // per_token
    tokens = min(max(unit, BACKWARD_QUERY_TOKENS), max(unit, tokens))
    return tokens // unit * unit, max_heads


Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(dq, dk, dv) accumulators."""
Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""(dout, q, k, v, out, lse): what one backward call reads."""


def _rel_backward(
    call: _Call, saved: Saved, grads: Grads, bs: int, tokens: int, pieces: list[tuple[int, ...]]
) -> None:
    """A rel call's backward, per batch row `tokens` query tokens (whole blocks) and one
    (query heads, K/V heads) piece at a time: each row's own keys (_rel_keys), their dk and dv
    added back block by block."""
    dout, q, k, v, out, lse = saved
    dq, dk, dv = grads
    n, kv_heads, dim = q.shape[1] // bs, k.shape[2], q.shape[3]
    diag = _call_diagonal(call, bs)
    for b in range(q.shape[0]):
        dk_blocks = dk[b, : n * bs].view(n, bs, kv_heads, dim)
        dv_blocks = dv[b, : n * bs].view(n, bs, kv_heads, dim)
        for (r0, r1), (a0, a1, c0, c1) in itertools.product(_chunks(call, tokens // bs), pieces):
            hq, hk = slice(a0, a1), slice(c0, c1)
            q_rows, lse_rows = _row_views(q, lse, b, r0, r1, bs)
            dq_b, dk_b, dv_b = block_backward(
                _row_views(dout, lse, b, r0, r1, bs)[0][:, :, hq],
                q_rows[:, :, hq],
                _rel_keys(k, b, r0, r1, call, bs)[:, :, hk],
                _rel_keys(v, b, r0, r1, call, bs)[:, :, hk],
                _row_views(out, lse, b, r0, r1, bs)[0][:, :, hq],
                lse_rows[:, hq],
                scale=dim**-0.5,
                causal=diag is not None,
                diagonal=diag or 0,
            )
            _row_views(dq, lse, b, r0, r1, bs)[0][:, :, hq].add_(dq_b)
            for t in range(call.key_blocks):  # slices, not a reshape: dk_b is strided
                j0, keys = r0 + call.a + t, slice(t * bs, (t + 1) * bs)
                dk_blocks[j0 : j0 + r1 - r0, :, hk].add_(dk_b[:, keys])
                dv_blocks[j0 : j0 + r1 - r0, :, hk].add_(dv_b[:, keys])
            del dq_b, dk_b, dv_b  # before the next call allocates its own


def _shared_backward(
    call: _Call, saved: Saved, grads: Grads, bs: int, tokens: int, pieces: list[tuple[int, ...]]
) -> None:
    """An abs or gathered call's backward (every query row shares its keys), `tokens` query
    tokens and one (query heads, K/V heads) piece at a time; dk and dv added back to the key
    range (abs) or scattered to the gathered blocks' tokens."""
    dout, q, k, v, out, lse = saved
    dq, dk, dv = grads
    seq_len = q.shape[1]
    diag = _call_diagonal(call, bs)
    if call.kind == "abs":
        keys, vals = (x[:, call.a * bs : call.b * bs] for x in (k, v))
    else:
        keys, vals = (_gather(x, call.blocks, bs) for x in (k, v))
    first = call.r0 * bs  # query tokens in any cut: the keys are the same for all
    spans = primitive.token_chunks(first, min(call.r1 * bs, seq_len), tokens)
    for (t0, t1), (a0, a1, c0, c1) in itertools.product(spans, pieces):
        rows, hq, hk = slice(t0, t1), slice(a0, a1), slice(c0, c1)
        dq_b, dk_b, dv_b = block_backward(
            dout[:, rows, hq],
            q[:, rows, hq],
            keys[:, :, hk],
            vals[:, :, hk],
            out[:, rows, hq],
            lse[:, hq, rows],
            scale=q.shape[3] ** -0.5,
            causal=diag is not None,
            diagonal=0 if diag is None else diag + t0 - first,
        )
        dq[:, rows, hq].add_(dq_b)
        if call.kind == "abs":
            dk[:, call.a * bs : call.b * bs, hk].add_(dk_b)
            dv[:, call.a * bs : call.b * bs, hk].add_(dv_b)
        else:
            idx = _token_index(call.blocks, bs, seq_len).to(q.device)
            dk[:, :, hk].index_add_(1, idx, dk_b)
            dv[:, :, hk].index_add_(1, idx, dv_b)
        del dq_b, dk_b, dv_b


def block_sparse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: BlockSparseParams,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the accumulator dtype: each call's block backward with the merged
    (out, lse).

    All inputs contiguous. Per call, key gradients come per query row and are summed into
    their blocks; rows per call are bounded so those copies stay small."""
    bs, heads, kv_heads = params.block_size, q.shape[2], k.shape[2]
    grads = zero_grads(q, k)
    calls = _backward_plan(
        params, q.shape[1], causal, SUPERBLOCK_TOKENS, BACKWARD_QUERY_TOKENS, BACKWARD_KEY_TOKENS
    )
    for call in calls:
        tokens, max_heads = _backward_split(call, bs, heads)
        pieces = primitive.kv_head_pieces(0, heads, heads, kv_heads, max_heads)
        run = _rel_backward if call.kind == "rel" else _shared_backward
        run(call, (dout, q, k, v, out, lse), grads, bs, tokens, pieces)
    return grads
