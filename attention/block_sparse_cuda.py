"""`block_sparse`'s CUDA plan: a few hundred large batched fused calls at most instead of the
CPU plan's many small ones (a CUDA call costs ~15 kernel launches whatever its size: the CPU
plan's 135K calls of a 128K backward are host-bound on an H100).

The plan (a pure function of the block mask, the length, causal and the accumulator windows):
- causal: the whole query blocks' diagonal blocks as batched causal calls on views of q, k, v
  (no copy; per batch row, within the call budget), the short last block's in one more;
- every other kept block pair as a "piece" (query block i, key blocks of i): each row's key
  list cut into chunks of at most `most` blocks (a power of two) and its remainder into powers
  of two, so every piece has one of log2(most) + 1 sizes; the short last key block is a piece
  of its own. Pieces of one (query tokens, key tokens) shape form a group; a group runs as
  batched calls (batch = B x items) on K/V gathered with one cached index each, at most
  `budget` gathered tokens per batch row a call (the transient bound), merged by lse into the
  rows' (out, lse) (forward: no row twice in one call) or scattered with accumulate
  (backward: dq, dk, dv).
Index tensors are built once per (plan, batch, device) and cached, so forward and backward make
no host-to-device copy and no sync. The flash op is the primitive's (block_forward /
block_backward), so on CPU the same plan runs the CPU flash op: exact, gradients included.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from attention.primitive import block_backward, block_forward, merge_

CALL_FRACTION = 4
"""A call gathers at most seq_len / CALL_FRACTION tokens (queries + keys) per batch row (at
least one item): its transient (gathered q, k, v, its block output and the rows' fp32 results)
stays within about 0.25x the bf16 floor (q, k, v, out), and a group's calls do not grow with
the length (a fixed window's pieces grow as the length). The price: a group of items x
(q_tokens + k_tokens) gathered tokens runs in CALL_FRACTION x that / seq_len calls, so the
calls grow with the kept blocks per row (a window given as a sparsity_ratio grows with n)."""
BACKWARD_CALL_FRACTION = 8
"""The backward's CALL_FRACTION: a backward call also holds its gathered dout and out and its
dq, dk, dv (fp32 from the op's), about twice a forward call's bytes per gathered token."""


@dataclass(frozen=True)
class Batch:
    """One batched fused call: item t is query block rows[t] against key blocks keys[t]
    (all items of one shape: q_tokens queries, k_tokens keys)."""

    rows: tuple[int, ...]
    keys: tuple[tuple[int, ...], ...]
    q_tokens: int
    k_tokens: int
    start: int = 0
    """The first query block of the accumulator window the rows lie in (forward)."""
    store: bool = False
    """Forward: no earlier call wrote these rows, so the call's result is stored, not merged."""


@dataclass(frozen=True)
class CudaPlan:
    """The CUDA plan of one (mask, length, causal, windows): `diagonal` (causal: the diagonal
    blocks run as batched causal calls) and the gathered batches of every other pair."""

    seq_len: int
    block_size: int
    diagonal: bool
    batches: tuple[Batch, ...]


def call_budget(seq_len: int, forward: bool = True) -> int:
    """Gathered tokens (queries + keys) per batch row of one forward (backward) call."""
    return max(1, seq_len // (CALL_FRACTION if forward else BACKWARD_CALL_FRACTION))


def _most_blocks(budget: int, bs: int) -> int:
    """The largest power of two p with (p + 1) * bs <= budget (at least 1): a piece's keys."""
    fit = max(1, budget // bs - 1)
    return 1 << (fit.bit_length() - 1)


def _cuts(cols: list[int], most: int) -> list[tuple[int, ...]]:
    """`cols` cut into chunks of `most` blocks, the remainder into descending powers of two."""
    pieces = [tuple(cols[i : i + most]) for i in range(0, len(cols) - len(cols) % most, most)]
    at, size = len(pieces) * most, most // 2
    while at < len(cols):
        if len(cols) - at >= size:
            pieces.append(tuple(cols[at : at + size]))
            at += size
        size //= 2
    return pieces


def _pieces(
    mask: torch.Tensor, seq_len: int, bs: int, causal: bool, most: int
) -> list[tuple[int, tuple[int, ...]]]:
    """(query block, key blocks) pieces covering every kept pair except, under causal, the
    diagonal blocks; the short last key block (seq_len % bs) is always a piece alone."""
    n = mask.shape[0]
    short = seq_len % bs != 0
    pieces: list[tuple[int, tuple[int, ...]]] = []
    for i in range(n):
        cols = [j for j in mask[i].nonzero().flatten().tolist() if not causal or j < i]
        if short and cols and cols[-1] == n - 1:
            pieces.append((i, (n - 1,)))
            cols = cols[:-1]
        pieces += [(i, piece) for piece in _cuts(cols, most)]
    return pieces


def build_plan(
    mask: torch.Tensor,
    seq_len: int,
    bs: int,
    causal: bool,
    window_starts: tuple[int, ...],
    distinct_rows: bool,
) -> CudaPlan:
    """The plan of block mask `mask` (n, n; causal trimming is done here). Forward
    (`distinct_rows`): batches hold no row twice and stay inside one accumulator window
    (query blocks from each of `window_starts`); backward: neither is needed."""
    mask = mask.tril() if causal else mask
    budget = call_budget(seq_len, distinct_rows)
    n = mask.shape[0]
    groups: dict[tuple[int, int, int], list[tuple[int, int, tuple[int, ...]]]] = {}
    rank: dict[tuple[tuple[int, int, int], int], int] = {}
    for i, piece in _pieces(mask, seq_len, bs, causal, _most_blocks(budget, bs)):
        q_tokens = min(bs, seq_len - i * bs)
        k_tokens = sum(min(bs, seq_len - j * bs) for j in piece)
        at = bisect.bisect_right(window_starts, i) if distinct_rows else 0
        key = (window_starts[at - 1] if at else 0, q_tokens, k_tokens)
        r = rank.get((key, i), 0) if distinct_rows else 0
        rank[key, i] = r + 1
        groups.setdefault(key, []).append((r, i, piece))
    batches: list[Batch] = []
    written = set(range(n)) if causal else set()  # the diagonal calls write every row first
    for (window, q_tokens, k_tokens), items in groups.items():
        for same_rank in _ranks(sorted(items)):
            rows_in_window = _window_rows(window, window_starts, n) if distinct_rows else n
            for part in _slices(same_rank, q_tokens + k_tokens, budget, rows_in_window):
                rows = tuple(i for _, i, _ in part)
                keys = tuple(p for _, _, p in part)
                store = distinct_rows and written.isdisjoint(rows)
                written.update(rows)
                batches.append(Batch(rows, keys, q_tokens, k_tokens, window, store))
    return CudaPlan(seq_len, bs, causal, tuple(batches))


def _window_rows(start: int, window_starts: tuple[int, ...], n: int) -> int:
    """Query blocks of the accumulator window starting at block `start`."""
    later = [w for w in window_starts if w > start]
    return (later[0] if later else n) - start


def _slices(items: list, tokens: int, budget: int, n: int) -> list[list]:
    """`items` (of `tokens` gathered tokens each) in calls of about `budget` tokens at most
    (one item more where the items do not divide evenly), spread evenly. The call count is that
    of ceil(items / n) * n items (n: query blocks of the window), at most one per item: the
    same at every length for a pattern of fixed size."""
    whole = -(-len(items) // n) * n
    calls = min(len(items), -(-whole * tokens // budget))
    cuts = [len(items) * c // calls for c in range(calls + 1)]
    return [items[a:b] for a, b in itertools.pairwise(cuts)]


def _ranks(items: list[tuple[int, int, tuple[int, ...]]]) -> list[list]:
    """Sorted (rank, row, piece) items cut where the rank changes (a forward batch holds each
    row once; the backward's items all have rank 0)."""
    runs: list[list] = []
    for item in items:
        if not runs or runs[-1][-1][0] != item[0]:
            runs.append([])
        runs[-1].append(item)
    return runs


def _token_positions(blocks: list[tuple[int, ...]], tokens: int, bs: int) -> torch.Tensor:
    """(items, tokens) token positions of each item's blocks, in block order: whole blocks of
    bs tokens, or one short last block of `tokens` (the plan keeps a short block alone)."""
    ids = torch.tensor(blocks, dtype=torch.int64)  # (items, blocks per item)
    per_block = tokens // ids.shape[1]
    return (ids[:, :, None] * bs + torch.arange(per_block)).flatten(1)


Indices = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]
"""Per batch: (b, t_q, t_q - window offset, t_k) int64 index tensors on the device."""


def plan_indices(plan: CudaPlan, bsz: int, device: torch.device) -> Indices:
    """Per batch of `plan`: b (B * items, 1) batch rows, batch row b's items first; t_q
    (B * items, q_tokens) the items' query positions; the same minus the batch's window's first
    token (its row in the window's accumulators); t_k (B * items, k_tokens) their keys'.
    Callers cache it per (plan, batch size, device): forward and backward copy nothing."""
    bs = plan.block_size
    result: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    for batch in plan.batches:
        q_pos = _token_positions([(i,) for i in batch.rows], batch.q_tokens, bs)
        k_pos = _token_positions(list(batch.keys), batch.k_tokens, bs)
        b = torch.arange(bsz).repeat_interleave(len(batch.rows))[:, None]
        tq = q_pos.repeat(bsz, 1)
        b, tq, rows, tk = (
            t.to(device) for t in (b, tq, tq - batch.start * bs, k_pos.repeat(bsz, 1))
        )
        result.append((b, tq, rows, tk))
    return tuple(result)


def _diagonal_views(x: torch.Tensor, b: int, r0: int, r1: int, bs: int) -> torch.Tensor:
    """(r1 - r0, bs, H, D) view of x[b]'s whole query blocks r0..r1."""
    return x[b, r0 * bs : r1 * bs].view(r1 - r0, bs, x.shape[2], x.shape[3])


def _diagonal_cuts(r0: int, r1: int, bs: int, budget: int) -> list[tuple[int, int]]:
    """Query blocks [r0, r1) cut into the fewest near-equal ranges whose diagonal calls gather
    (view) at most `budget` query + key tokens, like the plan's batches."""
    if r1 <= r0:
        return []
    calls = -(-(r1 - r0) * 2 * bs // budget)
    cuts = [r0 + (r1 - r0) * c // calls for c in range(calls + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _diagonal_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    plan: CudaPlan,
    r0: int,
    r1: int,
    scale: float,
) -> None:
    """Causal diagonal blocks of query blocks [r0, r1) stored into the window's (out, lse)
    (their first result), whose row 0 is block r0's first token: whole blocks per batch row
    in calls within the forward's budget (_diagonal_cuts), the short last block in one more."""
    bs, seq_len = plan.block_size, plan.seq_len
    whole = min(r1, seq_len // bs)
    cuts = _diagonal_cuts(r0, whole, bs, call_budget(seq_len, True))
    for b, (a, c) in itertools.product(range(q.shape[0]), cuts):
        qb, kb, vb = (_diagonal_views(x, b, a, c, bs) for x in (q, k, v))
        o_b, l_b = block_forward(qb, kb, vb, scale=scale, causal=True)
        _diagonal_views(out, b, a - r0, c - r0, bs).copy_(o_b)
        l_rows = lse[b, :, (a - r0) * bs : (c - r0) * bs].view(lse.shape[1], c - a, bs)
        l_rows.transpose(0, 1).copy_(l_b)
    if whole < r1:  # the short last block
        t0 = whole * bs
        o_b, l_b = block_forward(q[:, t0:], k[:, t0:], v[:, t0:], scale=scale, causal=True)
        at = (whole - r0) * bs
        out[:, at:].copy_(o_b)
        lse[:, :, at:].copy_(l_b)


def plan_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    plan: CudaPlan,
    index: Indices,
    r0: int,
    r1: int,
) -> None:
    """Query blocks [r0, r1) (an accumulator window) merged into (out, lse): out (B, Sw, H,
    D), lse (B, H, Sw), row 0 being block r0's first token (the plan's batches of these rows
    stay inside the window)."""
    scale = q.shape[3] ** -0.5
    if plan.diagonal:
        _diagonal_forward(q, k, v, out, lse, plan, r0, r1, scale)
    lse_t = lse.transpose(1, 2)  # (B, Sw, H)
    for batch, (b, tq, rows, tk) in zip(plan.batches, index, strict=True):
        if batch.start != r0:
            continue
        # (m, q_tokens, H, D) queries, (m, k_tokens, H_kv, D) keys: m = B * items
        o_b, l_b = block_forward(q[b, tq], k[b, tk], v[b, tk], scale=scale)
        if batch.store:
            out.index_put_((b, rows), o_b.to(out.dtype))
            lse_t.index_put_((b, rows), l_b.transpose(1, 2))
            continue
        o_acc, l_acc = out[b, rows], lse_t[b, rows]  # gathered copies of the rows' results
        merge_(o_acc, l_acc.transpose(1, 2), o_b, l_b)
        out.index_put_((b, rows), o_acc)
        lse_t.index_put_((b, rows), l_acc)
        del o_b, l_b, o_acc, l_acc


def _diagonal_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
    plan: CudaPlan,
    scale: float,
) -> None:
    """The causal diagonal blocks' gradients added into grads (dq, dk, dv), in calls within
    the backward's budget (_diagonal_cuts)."""
    bs, seq_len = plan.block_size, plan.seq_len
    whole = seq_len // bs
    cuts = _diagonal_cuts(0, whole, bs, call_budget(seq_len, False))
    for b, (a, c) in itertools.product(range(q.shape[0]), cuts):
        d_b, q_b, k_b, v_b, o_b = (_diagonal_views(x, b, a, c, bs) for x in (dout, q, k, v, out))
        l_rows = lse[b, :, a * bs : c * bs].view(lse.shape[1], c - a, bs).transpose(0, 1)
        parts = block_backward(d_b, q_b, k_b, v_b, o_b, l_rows, scale=scale, causal=True)
        for acc, part in zip(grads, parts, strict=True):
            _diagonal_views(acc, b, a, c, bs).add_(part)
    if whole * bs < seq_len:
        t0 = whole * bs
        d_s, q_s, k_s, v_s, o_s = (x[:, t0:] for x in (dout, q, k, v, out))
        parts = block_backward(d_s, q_s, k_s, v_s, o_s, lse[:, :, t0:], scale=scale, causal=True)
        for acc, part in zip(grads, parts, strict=True):
            acc[:, t0:].add_(part)


def plan_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
    plan: CudaPlan,
    index: Indices,
) -> None:
    """Every kept pair's gradients added into grads (dq, dk, dv; accumulator dtype), each
    batch's fused backward fed the final merged (out, lse) of its gathered rows."""
    scale = q.shape[3] ** -0.5
    dq, dk, dv = grads
    if plan.diagonal:
        _diagonal_backward(dout, q, k, v, out, lse, grads, plan, scale)
    lse_t = lse.transpose(1, 2)  # (B, S, H)
    for b, tq, _, tk in index:
        dq_b, dk_b, dv_b = block_backward(
            dout[b, tq],
            q[b, tq],
            k[b, tk],
            v[b, tk],
            out[b, tq],
            lse_t[b, tq].transpose(1, 2),
            scale=scale,
        )
        dq.index_put_((b, tq), dq_b, accumulate=True)
        dk.index_put_((b, tk), dk_b, accumulate=True)
        dv.index_put_((b, tk), dv_b, accumulate=True)
        del dq_b, dk_b, dv_b
