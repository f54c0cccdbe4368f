"""block_sparse's forward under the CPU plan: superblocks' shared runs and stairs, then the plan
calls, window by window, each call's queries and heads bounded by device (_forward_tokens,
_rows_per_call, _forward_heads)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import torch

from attention import primitive
from attention.block_sparse.cpu_plan import (
    _band,
    _Call,
    _call_diagonal,
    _chunks,
    _forward_plan,
    _gather,
    _rel_keys,
    _row_views,
    _rows,
    _store,
    _Superblock,
)
from attention.block_sparse.params import BlockSparseParams
from attention.primitive import block_forward, merge_

CHUNK_TOKENS = 2048
"""Bound on query tokens (forward) or per-row key tokens (backward) of one primitive call."""
FORWARD_TOKENS_PER_THREAD = 1024
"""On CPU, a forward call's query tokens per torch thread (at most CHUNK_TOKENS; see
_forward_tokens)."""
SUPERBLOCK_TOKENS = 768
"""Query tokens of the forward's superblocks (see _Superblock): consecutive query blocks whose
kept blocks are one wide run each (a local window) share most of it, computed by one call with
this many queries. The CPU flash op tiles 256 query rows from 768 queries but 32 below 192,
where one call per 64-token block ran at about 0.77x of its full rate."""


def _forward_tokens(device: torch.device) -> int:
    """Bound on the query tokens of one forward call (and on a stairs call's gathers).

    A call's transient bytes (its block output, a stairs call's gathered k and v) grow with
    its tokens, not with the sequence: under a memory budget they are the kernel's whole cost
    over the floor. On CPU the flash op needs a call's work only to keep every thread busy, so
    the bound is FORWARD_TOKENS_PER_THREAD per torch thread, at most CHUNK_TOKENS. Measured at
    the README example's shape (h4 d32, 31,744 tokens) in one thread, as a service rank runs:
    2048-token calls held 1.5-1.7 MB over the floor where the budget leaves 1.59 MB; 1024-token
    calls held 1.0 MB (0.05) and 1.25-1.6 MB with 2048-token stairs gathers (0.25). At two
    threads 1024-token calls ran block 64 at 0.92x SDPA against 0.93-0.96x (h8 d64, 16K)."""
    if device.type != "cpu":
        return CHUNK_TOKENS
    return min(CHUNK_TOKENS, FORWARD_TOKENS_PER_THREAD * torch.get_num_threads())


def _rows_per_call(device: torch.device, bs: int, tokens: int) -> int:
    """Query blocks of one forward plan call's primitive call: as many as `tokens`
    (_forward_tokens) hold, at least one; on CPU one block at a time from SUPERBLOCK_TOKENS
    tokens, which already fill the flash op's dense-sized tiles. On CUDA a call's thread blocks
    grow with its rows, so rows are never cut below the bound there."""
    if device.type == "cpu" and bs >= SUPERBLOCK_TOKENS:
        return 1
    return max(1, tokens // bs)


def _stair_rows(rows: int, bs: int, tokens: int) -> int:
    """Rows per stairs call of a shifted superblock of `rows` query blocks: c rows gather
    c + rows - 2 blocks of k and of v and output c blocks, within `tokens` (_forward_tokens)
    like any forward call; 0 when not even one row fits (then a call per run)."""
    fit = (tokens // bs - 2 * (rows - 2)) // 3
    return max(0, min(rows, fit))


def _forward_heads(q: torch.Tensor, k: torch.Tensor, queries: int) -> list[tuple[int, ...]]:
    """(a0, a1, c0, c1) query and kv head pieces of one forward call of `queries` queries per
    batch row. From SUPERBLOCK_TOKENS queries the CPU flash op holds the per-thread buffers of
    dense's one call (256-row tiles), so all such a call adds beyond dense's peak is its block
    output: in two head halves it holds half of it. Measured at the README example's shape
    (64 MiB, h4 d32, 31,744 tokens): block 1024 held 1.66 MB over the floor in whole calls,
    over the budget by 0.07 MB where dense fits. Smaller calls, and CUDA (where halving the
    heads halves a call's thread blocks), take all heads at once."""
    heads, kv_heads = q.shape[2], k.shape[2]
    halves = q.device.type == "cpu" and queries >= SUPERBLOCK_TOKENS and heads > 1
    return primitive.kv_head_pieces(0, heads, heads, kv_heads, heads // 2 if halves else None)


def _gather_runs(
    x: torch.Tensor, runs: list[tuple[int, int]], bs: int, buffer: torch.Tensor
) -> torch.Tensor:
    """The tokens of whole key block runs [j0, j1) of x (B, S, H, D), in order, copied into the
    front of `buffer` (reused: a fresh tensor per call costs its page faults every time)."""
    at = 0
    for j0, j1 in runs:
        part = x[:, j0 * bs : j1 * bs]
        buffer[:, at : at + part.shape[1]].copy_(part)
        at += part.shape[1]
    return buffer[:, :at]


class _Window(NamedTuple):
    """The forward's inputs (q, k, v) and one window's accumulators (out, lse), whose row 0 is
    query block `at`'s first token: what every part of the window's forward reads or fills."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    at: int


def _shared_forward(win: _Window, sup: _Superblock, bs: int, scale: float) -> None:
    """Superblock `sup`'s shared run, stored into its rows of the window's (out, lse)."""
    q, k, v, out, lse, at = win
    seq_len = q.shape[1]
    t0, t1 = sup.r0 * bs, min(seq_len, sup.r1 * bs)
    a, b = sup.shared
    keys, vals = (x[:, a * bs : min(seq_len, b * bs)] for x in (k, v))
    mine = slice(t0 - at * bs, t1 - at * bs)
    for a0, a1, c0, c1 in _forward_heads(q, k, t1 - t0):
        o_b, l_b = block_forward(
            q[:, t0:t1, a0:a1], keys[:, :, c0:c1], vals[:, :, c0:c1], scale=scale
        )
        out[:, mine, a0:a1].copy_(o_b)
        lse[:, a0:a1, mine].copy_(l_b)
        del o_b, l_b


def _stairs_forward(
    win: _Window,
    sup: _Superblock,
    bs: int,
    scale: float,
    buffers: tuple[torch.Tensor, torch.Tensor],
    tokens: int,
) -> None:
    """Superblock `sup`'s stairs merged into the window's (out, lse); `buffers` (batch 1): room
    for the blocks of k and of v a stairs call of at most `tokens` (_forward_tokens, the same
    value that sized them) gathers."""
    q, k, v, out, lse, at = win
    seq_len = q.shape[1]
    count, width = sup.r1 - sup.r0, sup.r1 - sup.r0 - 1
    per_call = _stair_rows(count, bs, tokens)
    if sup.shifted and per_call:
        l0, h0 = sup.stairs[0][0], sup.stairs[0][2]
        for i, t0 in itertools.product(range(q.shape[0]), range(0, count, per_call)):
            t1 = min(count, t0 + per_call)  # rows t0..t1 keep [t, t + width) of these:
            runs = [(l0 + t0, l0 + width), (h0, h0 + t1 - 1)]
            gathered = (
                _gather_runs(x[i : i + 1], runs, bs, buf)
                for x, buf in zip((k, v), buffers, strict=True)
            )
            stair_k, stair_v = (_band(x, 0, 0, t1 - t0, width, bs) for x in gathered)
            q_rows = _rows(q, i, sup.r0 + t0, sup.r0 + t1, bs)
            o_b, l_b = block_forward(q_rows, stair_k, stair_v, scale=scale)
            rows = _row_views(out, lse, i, sup.r0 + t0 - at, sup.r0 + t1 - at, bs)
            merge_(*rows, o_b, l_b)
            del o_b, l_b  # before the next call allocates its own
        return
    for t, (l0, l1, h0, h1) in enumerate(sup.stairs):
        row0, row1 = (sup.r0 + t) * bs, min(seq_len, (sup.r0 + t + 1) * bs)
        mine = slice(row0 - at * bs, row1 - at * bs)
        for j0, j1 in ((l0, l1), (h0, h1)):
            if j1 > j0:
                keys, vals = (x[:, j0 * bs : min(seq_len, j1 * bs)] for x in (k, v))
                o_b, l_b = block_forward(q[:, row0:row1], keys, vals, scale=scale)
                merge_(out[:, mine], lse[:, :, mine], o_b, l_b)
                del o_b, l_b


def block_sparse_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: BlockSparseParams, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,S,H,D) in q's dtype, lse (B,H,S) in the accumulator dtype) over the kept block
    pairs only, finished window by window (primitive.windowed_result); no graph. q, k, v must
    be contiguous."""
    seq_len = q.shape[1]
    bs, scale = params.block_size, q.shape[3] ** -0.5
    spans = primitive.windows(seq_len, q.dtype, bs)
    starts = tuple(c0 // bs for c0, _ in spans)
    supers, calls = _forward_plan(params, seq_len, causal, SUPERBLOCK_TOKENS, starts)
    tokens = _forward_tokens(q.device)  # once: it sizes the stairs' buffers
    rows_per_call = _rows_per_call(q.device, bs, tokens)
    gathering = [s for s in supers if s.shifted and _stair_rows(s.r1 - s.r0, bs, tokens)]
    most = max(
        (_stair_rows(s.r1 - s.r0, bs, tokens) + s.r1 - s.r0 - 2 for s in gathering), default=0
    )
    buffers: list[torch.Tensor] = []  # the stairs' k and v, allocated at their first use

    def fill(c0: int, c1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        at, end = c0 // bs, -(-c1 // bs)  # the window's query blocks
        mine = [sup for sup in supers if at <= sup.r0 < end]
        win = _Window(q, k, v, out, lse, at)
        for sup in mine:  # shared runs first: in one window, their outputs never meet buffers
            _shared_forward(win, sup, bs, scale)
        if mine and not buffers:
            buffers.extend(x.new_empty(1, most * bs, *x.shape[2:]) for x in (k, v))
        for sup in mine:
            _stairs_forward(win, sup, bs, scale, (buffers[0], buffers[1]), tokens)
        for call in calls:
            r0, r1 = max(call.r0, at), min(call.r1, end)
            if r0 < r1:
                _call_forward(win, dataclasses.replace(call, r0=r0, r1=r1), bs, rows_per_call)

    return primitive.windowed_result(q, fill, spans)


def _call_forward(win: _Window, call: _Call, bs: int, rows_per_call: int) -> None:
    """One plan call's rows, `rows_per_call` (_rows_per_call) at a time (on CPU in head halves
    from SUPERBLOCK_TOKENS queries, see _forward_heads), stored or merged into the window's
    (out, lse)."""
    q, k, v, out, lse, at = win
    bsz, seq_len = q.shape[:2]
    scale = q.shape[3] ** -0.5
    diag = _call_diagonal(call, bs)
    causal_call = {"causal": diag is not None, "diagonal": diag or 0}
    if call.kind == "rel":
        heads = _forward_heads(q, k, bs)
        for b, (r0, r1), (a0, a1, c0, c1) in itertools.product(
            range(bsz), _chunks(call, rows_per_call), heads
        ):
            hq, hk = slice(a0, a1), slice(c0, c1)
            keys = _rel_keys(k, b, r0, r1, call, bs)[:, :, hk]
            vals = _rel_keys(v, b, r0, r1, call, bs)[:, :, hk]
            o_b, l_b = block_forward(
                _rows(q, b, r0, r1, bs)[:, :, hq], keys, vals, scale=scale, **causal_call
            )
            o_rows, l_rows = _row_views(out, lse, b, r0 - at, r1 - at, bs)
            _store(o_rows[:, :, hq], l_rows[:, hq], o_b, l_b, call.merge)
            del o_b, l_b
        return
    if call.kind == "abs":
        keys, vals = (x[:, call.a * bs : call.b * bs] for x in (k, v))
    else:
        keys, vals = (_gather(x, call.blocks, bs) for x in (k, v))
    for r0, r1 in _chunks(call, rows_per_call):
        t0, t1 = r0 * bs, min(r1 * bs, seq_len)
        mine = slice(t0 - at * bs, t1 - at * bs)
        for a0, a1, c0, c1 in _forward_heads(q, k, t1 - t0):
            hq, hk = slice(a0, a1), slice(c0, c1)
            o_b, l_b = block_forward(
                q[:, t0:t1, hq], keys[:, :, hk], vals[:, :, hk], scale=scale, **causal_call
            )
            _store(out[:, mine, hq], lse[:, hq, mine], o_b, l_b, call.merge)
            del o_b, l_b
    del keys, vals  # a gather's copies, before the next call gathers
