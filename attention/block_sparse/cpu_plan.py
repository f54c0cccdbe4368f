"""block_sparse's CPU plan: the batched primitive calls that compute exactly the kept block
pairs (_plan), the forward's superblocks (_forward_plan), the backward's calls cut to bounded
keys (_backward_plan), and the views of q, k, v that those calls read."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from attention.block_sparse.params import BlockSparseParams, _cached_block_mask
from attention.primitive import merge_

MAX_VIEW_RUNS = 2
"""A query block whose kept key blocks form more contiguous runs than this gathers them."""


def _runs(cols: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs [j0, j1) of sorted block indices."""
    runs: list[tuple[int, int]] = []
    for j in cols:
        if runs and runs[-1][1] == j:
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


@dataclass(frozen=True)
class _Call:
    """One batched primitive call: query blocks [r0, r1) against key blocks given by `kind`.

    rel: key blocks [i + a, i + b) for query block i (an overlapping strided view of K);
    abs: key blocks [a, b) for every query block (a plain slice; cut at seq_len when b is the
    short last block); gather: one query block r0 against `blocks` (copied). `masked`: the
    last key block is the diagonal, causal inside.
    `merge`: these rows already hold a result (merge into it) rather than copy.
    """

    kind: str
    r0: int
    r1: int
    a: int = 0
    b: int = 0
    blocks: tuple[int, ...] = ()
    masked: bool = False
    merge: bool = False

    @property
    def key_blocks(self) -> int:
        return len(self.blocks) if self.kind == "gather" else self.b - self.a


def _consecutive(rows: list[int]) -> list[tuple[int, int]]:
    """Maximal ranges [r0, r1) of consecutive integers in sorted `rows`."""
    return _runs(rows)


@functools.lru_cache(maxsize=64)
def _plan(
    params: BlockSparseParams, seq_len: int, causal: bool, rows: frozenset[int] | None = None
) -> tuple[_Call, ...]:
    """The calls that compute exactly the kept block pairs of query blocks `rows` (None: all),
    query blocks batched where the key blocks follow the same rule (same offsets from the
    diagonal, or the same fixed blocks). The rows of a short last block (seq_len %
    block_size), and those that keep it, run "abs" calls (slices, no copy) or gathers."""
    mask = _cached_block_mask(params, seq_len)
    if causal:
        mask = mask.tril()
    n = mask.shape[0]
    short = seq_len % params.block_size != 0
    groups: dict[tuple, list[int]] = {}
    gathers: list[tuple[int, tuple[int, ...]]] = []
    for i in range(n) if rows is None else sorted(rows):
        cols = mask[i].nonzero().flatten().tolist()
        runs = _runs(cols)
        if len(runs) > MAX_VIEW_RUNS:
            gathers.append((i, tuple(cols)))
            continue
        ends_short = short and (i == n - 1 or cols[-1] == n - 1)
        for j0, j1 in runs:
            if ends_short:  # rel views need whole blocks; a slice of k is a view all the same
                key = ("abs", j0, j1, causal and j1 - 1 == i)
            elif j0 <= i < j1:
                key = ("rel", j0 - i, j1 - i, causal and j1 - 1 == i)
            else:
                key = ("abs", j0, j1, False)
            groups.setdefault(key, []).append(i)
    done = [False] * mask.shape[0]
    calls: list[_Call] = []
    for (kind, a, b, masked), rows in groups.items():
        for r0, r1 in _consecutive(rows):
            start = r0
            for r in range(r0 + 1, r1 + 1):  # split where the rows' copy/merge state changes
                if r == r1 or done[r] != done[start]:
                    calls.append(_Call(kind, start, r, a, b, (), masked, done[start]))
                    start = r
            done[r0:r1] = [True] * (r1 - r0)
    for i, cols in gathers:
        masked = causal and cols[-1] == i
        calls.append(_Call("gather", i, i + 1, blocks=cols, masked=masked, merge=done[i]))
        done[i] = True
    return tuple(calls)


def _chunks(call: _Call, rows_per_call: int) -> list[tuple[int, int]]:
    return [(r, min(call.r1, r + rows_per_call)) for r in range(call.r0, call.r1, rows_per_call)]


def _band(x: torch.Tensor, b: int, first: int, rows: int, width: int, bs: int) -> torch.Tensor:
    """(rows, width*bs, H, D) overlapping view of contiguous x[b] (x: (B, S, H, D)): row r
    sees the `width` blocks from block first + r."""
    _, s, h, d = x.shape
    tok = h * d
    offset = x.storage_offset() + b * s * tok + first * bs * tok
    return x.as_strided((rows, width * bs, h, d), (bs * tok, tok, d, 1), offset)


def _rel_keys(x: torch.Tensor, b: int, r0: int, r1: int, call: _Call, bs: int) -> torch.Tensor:
    """(r1 - r0, key_blocks*bs, H, D) overlapping view: row i sees blocks [i + a, i + b)."""
    return _band(x, b, r0 + call.a, r1 - r0, call.key_blocks, bs)


def _rows(x: torch.Tensor, b: int, r0: int, r1: int, bs: int) -> torch.Tensor:
    """(rows, bs, H, D) view of x[b] (x: (B, S, H, D)) for query blocks r0..r1."""
    return x[b, r0 * bs : r1 * bs].view(r1 - r0, bs, x.shape[2], x.shape[3])


def _row_views(x: torch.Tensor, lse: torch.Tensor, b: int, r0: int, r1: int, bs: int):
    """(rows, bs, H, D) view of x[b] and (rows, H, bs) view of lse[b] for query blocks r0..r1."""
    lse_rows = lse[b, :, r0 * bs : r1 * bs].view(lse.shape[1], r1 - r0, bs).transpose(0, 1)
    return _rows(x, b, r0, r1, bs), lse_rows


def _store(o_view, l_view, o_b, l_b, merge: bool) -> None:
    if merge:
        merge_(o_view, l_view, o_b, l_b)
    else:
        o_view.copy_(o_b)
        l_view.copy_(l_b)


@functools.lru_cache(maxsize=256)
def _token_index(blocks: tuple[int, ...], bs: int, seq_len: int) -> torch.Tensor:
    """Positions of `blocks`' tokens, in block order (the short last block cut at seq_len)."""
    return torch.cat([torch.arange(j * bs, min((j + 1) * bs, seq_len)) for j in blocks])


def _gather(x: torch.Tensor, blocks: tuple[int, ...], bs: int) -> torch.Tensor:
    """The tokens of `blocks` of x (B, S, H, D), copied in block order."""
    return x.index_select(1, _token_index(blocks, bs, x.shape[1]).to(x.device))


def _call_diagonal(call: _Call, bs: int) -> int | None:
    """The primitive's causal `diagonal` for a masked call's whole query block (its key blocks
    end with the diagonal block, so query t sees the keys before that block and the block's
    first t + 1), None for an unmasked call. A call on the block's queries [t0, t1) adds t0."""
    return (call.key_blocks - 1) * bs if call.masked else None


@dataclass(frozen=True)
class _Superblock:
    """Query blocks [r0, r1) whose kept key blocks are one run each, computed in the forward as
    the run they all share (one call of (r1 - r0)*bs queries) plus each block's "stairs"
    (its run's blocks outside the shared one), merged in.

    stairs[t]: query block r0 + t's key block ranges (l0, l1) and (h0, h1) around `shared`.
    `shifted`: the runs are one band shifted by a block per row (l0 and h1 grow by one each
    row, the unclipped interior of a local window), so that block t's stairs are the blocks
    [t, t + rows - 1) of X = [stairs[0].l0, l1 of the last row) ++ [h0, h1 of the last row):
    rows t0..t1 gather the part of X they keep and run one call (_stair_rows rows a call).
    Otherwise (or when no row fits a call) one call per row and stair, on views of k and v.
    Causal: the runs end before the diagonal, whose masked blocks run as a plan call."""

    r0: int
    r1: int
    shared: tuple[int, int]
    stairs: tuple[tuple[int, int, int, int], ...]
    shifted: bool


def _row_runs(
    mask: torch.Tensor, causal: bool, exclude: int | None
) -> list[tuple[int, int] | None]:
    """Per query block i, its kept key blocks [j0, j1) when they are one run (causal: one run
    ending at the diagonal, j1 = i, the diagonal left out), else None; None for `exclude`."""
    runs: list[tuple[int, int] | None] = []
    for i in range(mask.shape[0]):
        cols = mask[i].nonzero().flatten().tolist()
        j0, j1 = cols[0], cols[-1] + 1
        one = len(cols) == j1 - j0 and (not causal or j1 == i + 1)
        runs.append((j0, i if causal else j1) if one and i != exclude else None)
    return runs


def _superblock(
    runs: list[tuple[int, int] | None], r0: int, r1: int, whole: int
) -> _Superblock | None:
    """Rows [r0, r1) as a superblock, if there are two or more, their runs grow monotonically
    and the shared run is at least twice as wide as the stairs of a row (else the stairs' small
    calls cost more than the shared call saves). `whole`: blocks [0, whole) are full blocks,
    which a shifted superblock's views need."""
    rows = [runs[i] for i in range(r0, r1)]
    if r1 - r0 < 2 or any(r is None for r in rows):
        return None
    j0s, j1s = [r[0] for r in rows if r], [r[1] for r in rows if r]
    if j0s != sorted(j0s) or j1s != sorted(j1s):
        return None
    shared = (j0s[-1], j1s[0])
    if shared[1] - shared[0] < 2 * (r1 - r0 - 1) or shared[1] <= shared[0]:
        return None
    stairs = tuple((a, shared[0], shared[1], b) for a, b in zip(j0s, j1s, strict=True))
    step = list(range(r1 - r0))
    shifted = [a - j0s[0] for a in j0s] == step and [b - j1s[0] for b in j1s] == step
    shifted = shifted and r1 <= whole and j1s[-1] <= whole
    return _Superblock(r0, r1, shared, stairs, shifted)


@functools.lru_cache(maxsize=64)
def _forward_plan(
    params: BlockSparseParams,
    seq_len: int,
    causal: bool,
    superblock_tokens: int,
    window_starts: tuple[int, ...] = (),
) -> tuple[tuple[_Superblock, ...], tuple[_Call, ...]]:
    """The forward's superblocks (SUPERBLOCK_TOKENS of queries each, where rows qualify, none
    across the query blocks `window_starts` that start the forward's windows) and the plan
    calls of every other row; causal superblock rows' diagonals are masked calls."""
    bs = params.block_size
    group = superblock_tokens // bs
    if group < 2:
        return (), _plan(params, seq_len, causal)
    mask = _cached_block_mask(params, seq_len)
    mask = mask.tril() if causal else mask
    n = mask.shape[0]
    runs = _row_runs(mask, causal, n - 1 if seq_len % bs else None)
    supers: list[_Superblock] = []
    i = 0
    while i < n:
        edge = min((w for w in window_starts if w > i), default=n)
        sup = _superblock(runs, i, min(n, i + group, edge), seq_len // bs)
        if sup is None:
            i += 1
            continue
        supers.append(sup)
        i = sup.r1
    covered = {i for sup in supers for i in range(sup.r0, sup.r1)}
    calls = _plan(params, seq_len, causal, frozenset(set(range(n)) - covered))
    if causal:
        calls += tuple(
            _Call("rel", sup.r0, sup.r1, 0, 1, masked=True, merge=True) for sup in supers
        )
    return tuple(supers), calls


def _key_parts(call: _Call, bs: int, key_tokens: int) -> list[_Call]:
    """`call` cut into calls of at most `key_tokens` keys (at least one block) for the backward,
    whose per-call dk, dv would otherwise grow with the keys a row keeps (O(S) for a window
    that is a fraction of the sequence). Gradients of key subsets simply add up; the causal
    diagonal stays the last block of the last part."""
    most = max(1, key_tokens // bs)
    if call.key_blocks <= most:
        return [call]
    if call.kind == "gather":
        cuts = [call.blocks[i : i + most] for i in range(0, len(call.blocks), most)]
        return [
            dataclasses.replace(call, blocks=cut, masked=call.masked and cut is cuts[-1])
            for cut in cuts
        ]
    return [
        dataclasses.replace(
            call, a=a0, b=min(call.b, a0 + most), masked=call.masked and a0 + most >= call.b
        )
        for a0 in range(call.a, call.b, most)
    ]


@functools.lru_cache(maxsize=64)
def _backward_plan(
    params: BlockSparseParams,
    seq_len: int,
    causal: bool,
    superblock_tokens: int,
    query_tokens: int,
    key_tokens: int,
) -> tuple[_Call, ...]:
    """The backward's calls: the forward's plan (_forward_plan), each superblock as plain calls
    (its shared run one abs call for all its rows, a row's stairs abs calls of their own), all
    cut by _key_parts. A superblock's shared run shares its dk and dv among its rows, where a
    rel call gives each row its own: the same memory holds more work. Blocks of `query_tokens`
    (BACKWARD_QUERY_TOKENS) or more turn rel calls into a row's abs call each; `key_tokens`
    (BACKWARD_KEY_TOKENS) bounds the key parts. The constants are arguments: the cache's key."""
    bs = params.block_size
    supers, calls = _forward_plan(params, seq_len, causal, superblock_tokens)
    parts: list[_Call] = []
    for sup in supers:
        parts.append(_Call("abs", sup.r0, sup.r1, *sup.shared))
        for t, (l0, l1, h0, h1) in enumerate(sup.stairs):
            row = sup.r0 + t
            parts += [
                _Call("abs", row, row + 1, j0, j1) for j0, j1 in ((l0, l1), (h0, h1)) if j1 > j0
            ]
    if bs >= query_tokens:  # a row fills a call: as abs calls its queries can be cut
        calls = tuple(
            _Call("abs", r, r + 1, r + c.a, r + c.b, masked=c.masked) if c.kind == "rel" else c
            for c in calls
            for r in (range(c.r0, c.r1) if c.kind == "rel" else [c.r0])
        )
    return tuple(part for call in (*parts, *calls) for part in _key_parts(call, bs, key_tokens))
