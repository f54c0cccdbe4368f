"""`block_sparse`'s CUDA plan for band patterns: a handful of fused calls on strided views.

local_window and global_local keep a block pair (i, j) by its offset i - j alone
(global_local: outside its global rows and columns). Cut the query and key blocks into chunks
of C blocks; every chunk pair (I, J) on one chunk diagonal D = I - J then keeps the same
C x C block sub-mask. So one fused call runs a whole chunk diagonal: its items are the chunk
pairs, q a strided view of the query chunks and K/V the same of the key chunks (items C blocks
apart on both sides: no copy, and no two items share a key, so the backward's dk and dv add
straight back through the view). A diagonal whose sub-mask keeps every pair is a plain call;
the causal diagonal D = 0 whose sub-mask keeps every block at or below the diagonal is a causal
call (block causal + token causal inside the diagonal blocks IS token causal); any other is a
masked call, its additive mask built once per (plan, device, dtype), trimmed to the sub-mask's
kept rows and columns first. A partial last chunk (the length no multiple of C blocks, or a
short last block) is the first tokens of a whole chunk: its items on each diagonal are calls of
their own, with the whole chunk's mask sliced. global_local whose global blocks lie inside its
band (num_global <= window + 1, the default 1 global block) runs the band on every block (its
chunks then start at token 0: no partial chunk where the length is a multiple of C blocks) and
the pairs past the band as at most two plain rectangles (the global rows' keys past their
window, not causal; the global columns of the rows past theirs) and two small masked boxes
where the window's end cuts through the global blocks (_strip_calls); with more global blocks,
its global rows and columns are two plain (or causal) calls and its band runs on the blocks
after them.

Where the window ends just past a chunk diagonal (a sliver diagonal each side), the slivers
run in the next diagonals' calls (their keys run on into the next key chunk) and the two items
left over in one call of two masks, so four calls become three (_merge_slivers).

C is the power of two (C x block_size within MASK_TOKENS, so a mask holds at most
MASK_TOKENS^2 elements), slivers merged or not, that makes the fewest calls while computing at
most WASTE_BOUND x the kept pairs: a window of w blocks runs in about 2w/C + 1 calls each
way, whatever the length (calls after the first whose output is nearly a whole output run as
two halves, so the forward's transient stays within a quarter of the floor: SPLIT_FRACTION).
The price: a masked call computes its (trimmed) chunk pairs whole, kept or not (a window's
fringe), so the plan computes more pairs than are kept. `random` (no band) and `dilated` (a
band of every other offset, which took 10 chunk diagonals here at 128K, density 0.25, and
computed twice its kept pairs) run FlexAttention instead (attention.block_sparse_flex).

Merging: every call's (out, lse) is merged in place into out (q's dtype, as dilated's cuda plan:
bf16 rounds once per call a row takes part in) and lse ((B, S, H) in memory, (B, H, S) view).
The backward recomputes each call with the final (out, lse) (FlashAttention-2) and adds its
dq, dk, dv into fp32 accumulators through the same views. No index tensors, no host sync.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from attention import primitive

MASK_TOKENS = 8192
"""The most tokens of a chunk (C x block_size): a mask holds at most MASK_TOKENS^2 elements."""


@dataclass(frozen=True)
class Call:
    """One fused call: item t (t < count) is queries [q0 + t*stride, + sq) against keys
    [k0 + t*ks, + sk). `mask`: (D, r0, r1, c0, c1) the token rows and columns of chunk
    diagonal D's whole-chunk mask it uses (D a str: global_local's box of that name; a tuple:
    a call of _merge_slivers, whose edge call has one mask per item), None for a plain call;
    `causal`: a causal square; `empty`: some query row keeps no key of this call (its lse is
    set to -inf)."""

    q0: int
    k0: int
    sq: int
    sk: int
    count: int
    stride: int
    mask: tuple[Hashable, int, int, int, int] | None = None
    causal: bool = False
    empty: bool = False
    k_stride: int | None = None
    """The keys' stride between items where it differs from the queries' (`stride`)."""

    @property
    def ks(self) -> int:
        """The keys' stride between items."""
        return self.stride if self.k_stride is None else self.k_stride


@dataclass(frozen=True, eq=False)
class BandPlan:
    """The calls of one (pattern, length, causal) and the block sub-masks (C x C, bool) of the
    chunk diagonals that need a mask; `chunk` is C, `causal_diagonal` whether D = 0 also masks
    tokens causally inside its diagonal blocks."""

    seq_len: int
    block_size: int
    chunk: int
    calls: tuple[Call, ...]
    submasks: dict[Hashable, Tensor]
    causal: bool


def kept_offsets(n: int, window: int, causal: bool) -> Tensor:
    """bool (2n - 1,): entry o + n - 1 says whether the band keeps block offset o = i - j."""
    keep = torch.arange(-(n - 1), n).abs() <= window
    if causal:
        keep &= torch.arange(-(n - 1), n) >= 0
    return keep


def chunk_candidates(n: int, bs: int) -> list[int]:
    """Chunk sizes tried: powers of two C <= n with C * bs <= MASK_TOKENS (at least 1)."""
    sizes, chunk = [1], 2
    while chunk <= n and chunk * bs <= MASK_TOKENS:
        sizes.append(chunk)
        chunk *= 2
    return sizes


def computed_pairs(calls: tuple[Call, ...] | list[Call]) -> int:
    """Token pairs the calls compute (a masked call's dropped pairs included)."""
    return sum(c.count * (c.sq * (c.sq + 1) // 2 if c.causal else c.sq * c.sk) for c in calls)


def _submask(keep: Tensor, d: int, chunk: int) -> Tensor:
    """(C, C) bool: block a of query chunk I against block b of key chunk I - d."""
    a = torch.arange(chunk)
    offset = d * chunk + a[:, None] - a[None, :]
    n1 = keep.shape[0] // 2
    inside = offset.abs() <= n1
    return keep[(offset + n1).clamp(0, 2 * n1)] & inside


def build_plan(
    seq_len: int,
    bs: int,
    causal: bool,
    window: int,
    num_global: int = 0,
    kept_pairs: int = 0,
) -> BandPlan:
    """The band plan (module docstring) of a band pattern (window: the pattern's;
    num_global: global_local's global blocks, else 0; kept_pairs: the token pairs the mask
    keeps, which bounds the waste of a chunk size)."""
    n = -(-seq_len // bs)
    g = min(num_global, n)
    boxes: dict[Hashable, Tensor] = {}
    if g and g <= window + 1 and g * bs <= MASK_TOKENS:  # global blocks inside the band
        strips, g = _strip_calls(seq_len, bs, g, window, causal, boxes), 0
        first: list[Call] = []
    else:
        strips, first = [], _global_calls(seq_len, bs, g, causal)
    rest = n - g
    if not rest:
        return BandPlan(seq_len, bs, 1, tuple(_split(first, seq_len)), {}, causal)
    keep = kept_offsets(rest, window, causal)
    best: BandPlan | None = None
    for chunk, merge in itertools.product(chunk_candidates(rest, bs), (False, True)):
        submasks = dict(boxes)
        band = _band_calls(keep, seq_len, bs, g, chunk, causal, submasks, merge)
        calls = tuple(_split(first + band + strips, seq_len))
        plan = BandPlan(seq_len, bs, chunk, calls, submasks, causal)
        if best is None or _better(plan, best, kept_pairs):
            best = plan
    return best  # type: ignore[return-value]


def _strip_calls(
    seq_len: int, bs: int, g: int, window: int, causal: bool, boxes: dict[Hashable, Tensor]
) -> list[Call]:
    """global_local's pairs outside its band when the band runs on every block (g <= window + 1:
    the global blocks' own pairs are inside it): the global rows against the keys past their
    window (not causal: causally a global row's keys are all inside it) and the other rows'
    global columns past theirs. Each strip is a plain rectangle where every global block keeps
    it, and a small masked box ((g - 1) x (g - 1) blocks, "rows" / "cols" in `boxes`) where the
    window's end cuts through the global blocks (global block i keeps block j iff j - i >
    window: none of the last global block's, and every box row and column keeps some)."""
    n = -(-seq_len // bs)
    calls: list[Call] = []
    if window + 1 >= n:
        return calls
    gt, wt = g * bs, min(seq_len, (g + window) * bs)
    if wt < seq_len:  # every global block keeps these keys (queries)
        if not causal:
            calls.append(Call(0, wt, gt, seq_len - wt, 1, 0))
        calls.append(Call(wt, 0, seq_len - wt, gt, 1, 0))
    lo, hi = window + 1, min(n, g + window)
    if hi > lo:  # keys (queries) [lo, hi) that only the first g - 1 global blocks keep
        i = torch.arange(g - 1)[:, None]
        j = torch.arange(lo, hi)[None, :]
        boxes["rows"] = j - i > window  # global row i, key block j
        boxes["cols"] = boxes["rows"].T.contiguous()  # query block j, global column i
        rows, cols = (g - 1) * bs, min(seq_len, hi * bs) - lo * bs
        if not causal:
            calls.append(Call(0, lo * bs, rows, cols, 1, 0, mask=("rows", 0, rows, 0, cols)))
        calls.append(Call(lo * bs, 0, cols, rows, 1, 0, mask=("cols", 0, cols, 0, rows)))
    return calls


WASTE_BOUND = 3
"""A chunk size is taken only while its calls compute at most WASTE_BOUND x the kept token
pairs (masks drop the rest); among those, the one with the fewest calls (ties: the smaller)."""


def _better(plan: BandPlan, best: BandPlan, kept: int) -> bool:
    """Whether `plan` (a larger chunk) beats `best` (module docstring: fewest calls within the
    waste bound)."""
    if computed_pairs(plan.calls) > WASTE_BOUND * kept:
        return False
    return len(plan.calls) < len(best.calls)


SPLIT_FRACTION = 16
"""A call after the first whose rows exceed seq_len * (1 - 1/SPLIT_FRACTION) runs as two
halves: its output (nearly a whole output) and its lse and merge weights would take the
forward's transient past a quarter of the floor (the first call's output is the output)."""


def _split(calls: list[Call], seq_len: int) -> list[Call]:
    """`calls` with every call but the first cut in two halves (items, or rows of one item)
    when its rows exceed the SPLIT_FRACTION bound."""
    bound = seq_len - seq_len // SPLIT_FRACTION
    result = calls[:1]
    for call in calls[1:]:
        if call.sq * call.count <= bound or (call.mask is not None and call.count == 1):
            result.append(call)
        elif call.count > 1:
            half = call.count // 2
            result.append(dataclasses.replace(call, count=half))
            rest = dataclasses.replace(
                call, q0=call.q0 + half * call.stride, k0=call.k0 + half * call.ks
            )
            result.append(dataclasses.replace(rest, count=call.count - half))
        elif not call.causal:  # one plain rectangle: its rows in two halves
            half = call.sq // 2
            result.append(dataclasses.replace(call, sq=half))
            result.append(dataclasses.replace(call, q0=call.q0 + half, sq=call.sq - half))
        else:
            result.append(call)
    return result


def _global_calls(seq_len: int, bs: int, g: int, causal: bool) -> list[Call]:
    """global_local's global rows (every key, or causally the keys before them) and the other
    rows' global columns."""
    if not g:
        return []
    tg = min(seq_len, g * bs)
    calls = [Call(0, 0, tg, tg, 1, 0, causal=True) if causal else Call(0, 0, tg, seq_len, 1, 0)]
    if tg < seq_len:
        calls.append(Call(tg, 0, seq_len - tg, tg, 1, 0))
    return calls


def _band_calls(
    keep: Tensor,
    seq_len: int,
    bs: int,
    g: int,
    chunk: int,
    causal: bool,
    submasks: dict[Hashable, Tensor],
    merge: bool,
) -> list[Call]:
    """The calls of every chunk diagonal of the band on blocks [g, n); `merge`: the outermost
    diagonals merged into the next ones where they can be (_merge_slivers)."""
    n = -(-seq_len // bs)
    rest = n - g
    m = -(-rest // chunk)
    ctok = chunk * bs
    start = g * bs

    def tokens(i: int) -> int:  # tokens of chunk i
        return min(seq_len, start + (i + 1) * ctok) - (start + i * ctok)

    whole = m if tokens(m - 1) == ctok else m - 1
    calls: list[Call] = []
    diag: list[int] = []  # each call's chunk diagonal
    for d in sorted(range(-(m - 1), m), key=abs):  # D = 0 first: its output may be adopted
        sub = _submask(keep, d, chunk)
        if not sub.any():
            continue
        items = [(i, i - d) for i in range(max(0, d), min(m, m + d))]
        main = [(i, j) for i, j in items if i < whole and j < whole]
        tails = [(i, j) for i, j in items if i >= whole or j >= whole]
        groups = ([main] if main else []) + [[t] for t in tails]
        for group in groups:
            i, j = group[0]
            qt, kt = tokens(i), tokens(j)
            qb, kb = -(-qt // bs), -(-kt // bs)
            rc = _trim(sub[:qb, :kb], bs, qt, kt)
            if rc is None:
                continue
            origin = (start + i * ctok, start + j * ctok)
            call = _make(origin, len(group), ctok, d, rc, sub[:qb, :kb], bs, causal)
            if call.mask is not None:
                submasks[d] = sub
            calls.append(call)
            diag.append(d)
    if merge and whole == m and not causal:
        return _merge_slivers(calls, diag, keep, bs, chunk, m, start, submasks)
    return calls


def _merge_slivers(
    calls: list[Call],
    diag: list[int],
    keep: Tensor,
    bs: int,
    chunk: int,
    m: int,
    start: int,
    submasks: dict[Hashable, Tensor],
) -> list[Call]:
    """The band's calls with its outermost diagonals +-top (slivers: the window's end) merged
    into the next ones +-(top - 1), one call a side: item I's keys run from diagonal top's key
    chunk on into diagonal top - 1's (contiguous), with the two sub-masks side by side. The
    one item of each side's inner diagonal left over (its first on +, its last on -) goes to
    one more call of two items, each with its own mask (queries and keys strided apart). Four
    calls become three. Taken only with whole chunks, not causal, when the slivers' keys reach
    their chunk's end (+; its start: -), the two leftovers have one shape and do not overlap,
    and no row of the four calls keeps nothing; else `calls` as given."""
    top = max(abs(d) for d in diag)
    want = (top - 1, top, 1 - top, -top)
    if top < 2 or any(diag.count(d) != 1 for d in want):
        return calls
    if any(calls[diag.index(d)].empty for d in want):
        return calls
    ctok = chunk * bs
    sub = {d: _submask(keep, d, chunk) for d in want}
    rc = {d: _trim(sub[d], bs, ctok, ctok) for d in want}  # (r0, r1, c0, c1) tokens
    a, s, a2, s2 = (rc[d] for d in want)
    if a is None or s is None or a2 is None or s2 is None:
        return calls
    if a[2] != 0 or s[3] != ctok or a2[3] != ctok or s2[2] != 0:
        return calls  # the slivers' keys do not run on into the inner diagonals'
    sq, sk = a[1] - a[0], a[3] - a[2]
    q_plus, k_plus = start + (top - 1) * ctok + a[0], start + a[2]
    q_minus, k_minus = start + (m - top) * ctok + a2[0], start + (m - 1) * ctok + a2[2]
    if (sq, sk) != (a2[1] - a2[0], a2[3] - a2[2]) or q_minus - q_plus < sq or k_minus - k_plus < sk:
        return calls
    merged = [
        _merged_side(sub[top], sub[top - 1], s, a, start + top * ctok, start, m - top, ctok, 1),
        _merged_side(sub[1 - top], sub[-top], a2, s2, start, start + (top - 1) * ctok,
                     m - top, ctok, -1),
    ]  # fmt: skip
    for call, blocks in merged:
        submasks[call.mask[0]] = blocks  # type: ignore[index]
    blocks = [sub[d][r0 // bs : r1 // bs, c0 // bs : c1 // bs] for d, (r0, r1, c0, c1) in
              ((top - 1, a), (1 - top, a2))]  # fmt: skip
    submasks[("edges",)] = torch.stack(blocks)
    edges = Call(q_plus, k_plus, sq, sk, 2, q_minus - q_plus, (("edges",), 0, sq, 0, sk),
                 k_stride=k_minus - k_plus)  # fmt: skip
    kept = [c for c, d in zip(calls, diag, strict=True) if d not in want]
    return kept + [call for call, _ in merged] + [edges]


def _merged_side(
    first: Tensor,
    second: Tensor,
    rc1: tuple[int, int, int, int],
    rc2: tuple[int, int, int, int],
    q_chunk: int,
    k_chunk: int,
    count: int,
    ctok: int,
    sign: int,
) -> tuple[Call, Tensor]:
    """One side's merged call (_merge_slivers) and its block mask: keys `first`'s sub-mask
    from its first kept column to the chunk's end, then `second`'s to its last kept column;
    rows those either keeps. q_chunk, k_chunk: the first item's query and key chunk tokens."""
    bs = ctok // first.shape[0]
    r0, r1 = min(rc1[0], rc2[0]), max(rc1[1], rc2[1])
    c0, c1 = rc1[2], rc2[3]
    blocks = torch.cat([first[:, c0 // bs :], second[:, : c1 // bs]], dim=1)
    width = ctok - c0 + c1
    empty = not bool(blocks[r0 // bs : r1 // bs].any(1).all())
    mask = (("merged", sign), r0, r1, 0, width)
    stride = ctok if count > 1 else 0
    call = Call(q_chunk + r0, k_chunk + c0, r1 - r0, width, count, stride, mask, empty=empty)
    return call, blocks


def _trim(sub: Tensor, bs: int, qt: int, kt: int) -> tuple[int, int, int, int] | None:
    """Token rows [r0, r1) and columns [c0, c1) of a chunk pair's call: its (qt x kt tokens)
    sub-mask trimmed to the kept rows and columns; None when it keeps nothing."""
    rows, cols = sub.any(1).nonzero().flatten(), sub.any(0).nonzero().flatten()
    if not len(rows):
        return None
    r0, r1 = int(rows[0]) * bs, min(qt, (int(rows[-1]) + 1) * bs)
    c0, c1 = int(cols[0]) * bs, min(kt, (int(cols[-1]) + 1) * bs)
    return r0, r1, c0, c1


def _make(
    origin: tuple[int, int],
    count: int,
    ctok: int,
    d: int,
    rc: tuple[int, int, int, int],
    sub: Tensor,
    bs: int,
    causal: bool,
) -> Call:
    """The Call of a trimmed chunk-pair group (first item's query and key chunk starting at
    tokens `origin`): plain, causal or masked."""
    r0, r1, c0, c1 = rc
    q0, k0 = origin[0] + r0, origin[1] + c0
    part = sub[r0 // bs : -(-r1 // bs), c0 // bs : -(-c1 // bs)]
    stride = ctok if count > 1 else 0
    token_causal = causal and d == 0
    if part.all() and not token_causal:
        return Call(q0, k0, r1 - r0, c1 - c0, count, stride)
    if token_causal and (r0, r1) == (c0, c1) and torch.equal(part, torch.ones_like(part).tril()):
        return Call(q0, k0, r1 - r0, c1 - c0, count, stride, causal=True)
    empty = not bool(part.any(1).all())
    return Call(q0, k0, r1 - r0, c1 - c0, count, stride, mask=(d, r0, r1, c0, c1), empty=empty)


@functools.lru_cache(maxsize=64)
def _bias(plan: BandPlan, d: Hashable, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Chunk diagonal d's whole-chunk additive mask (C*bs, C*bs) on `device` (d a str: that
    global_local box's, its blocks' tokens): 0 where kept, -inf elsewhere (D = 0 under causal:
    also above the token diagonal). Built once per (plan, device, dtype): the one
    host-to-device copy, made by the first (warm-up) call."""
    sub = plan.submasks[d]  # (rb, cb), or (items, rb, cb): one mask per item
    rows, cols = (torch.arange(x * plan.block_size) // plan.block_size for x in sub.shape[-2:])
    keep = sub[..., rows, :][..., cols]
    if plan.causal and d == 0:
        keep &= torch.ones_like(keep).tril()
    bias = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
    return bias.to(device)


@functools.lru_cache(maxsize=256)
def _empty_rows(plan: BandPlan, index: int, device: torch.device) -> Tensor:
    """bool (sq,): the query rows of masked call `index` that keep none of its keys."""
    d, r0, r1, c0, c1 = plan.calls[index].mask  # type: ignore[misc]
    keep = _bias(plan, d, torch.device("cpu"), torch.float32)[..., r0:r1, c0:c1]
    return torch.isneginf(keep).all(-1).to(device)


def _view(
    x: Tensor, start: int, length: int, call: Call, b: int | None, keys: bool = False
) -> Tensor:
    """x (B, S, H, D)'s tokens [start + t*stride, + length) of every item t as (N, H, length,
    D): N = count (batch row b) or B * count (b None: folded, items spanning the sequence);
    `keys`: the keys' stride (call.ks)."""
    sb, ss, sh, sd = x.stride()
    n = call.count * (x.shape[0] if b is None else 1)
    offset = x.storage_offset() + (b or 0) * sb + start * ss
    stride = call.ks if keys else call.stride
    return x.as_strided((n, x.shape[2], length, x.shape[3]), (stride * ss, sh, ss, sd), offset)


def _lse_view(lse: Tensor, call: Call, b: int | None) -> Tensor:
    """lse (B, S, H)'s rows of the call as (N, H, sq)."""
    sb, ss, sh = lse.stride()
    n = call.count * (lse.shape[0] if b is None else 1)
    offset = lse.storage_offset() + (b or 0) * sb + call.q0 * ss
    return lse.as_strided((n, lse.shape[2], call.sq), (call.stride * ss, sh, ss), offset)


def _batch_rows(call: Call, bsz: int, seq_len: int) -> list[int | None]:
    """One folded call when the items span the sequence (or B == 1), else one per batch row."""
    spans = call.count * call.stride == seq_len and call.q0 == call.k0 == 0
    fold = bsz == 1 or (spans and call.ks == call.stride)
    return [None] if fold else list(range(bsz))


def _call_bias(plan: BandPlan, call: Call, n: int, heads: int, device, dtype) -> Tensor:
    """The call's mask as an (N, H, sq, sk) stride-0 view of its diagonal's whole mask (one
    mask per item: N = count, the items' masks)."""
    d, r0, r1, c0, c1 = call.mask  # type: ignore[misc]
    bias = _bias(plan, d, device, dtype)[..., r0:r1, c0:c1]
    bias = bias[:, None] if bias.dim() == 3 else bias
    return bias.expand(n, heads, call.sq, call.sk)


def forward(q: Tensor, k: Tensor, v: Tensor, plan: BandPlan) -> tuple[Tensor, Tensor]:
    """(out (B, S, H, D) in q's dtype, lse (B, H, S) accumulator dtype) of the plan's calls on
    contiguous q, k, v; no graph."""
    bsz, seq_len, heads, dim = q.shape
    backend = primitive.backend_for(q.device, q.dtype)
    acc = primitive.accumulator_dtype(q.dtype)
    lse = torch.full((bsz, seq_len, heads), float("-inf"), dtype=acc, device=q.device)
    out: Tensor | None = None
    for index, call in enumerate(plan.calls):
        for b in _batch_rows(call, bsz, seq_len):
            qv = _view(q, call.q0, call.sq, call, b)
            kv, vv = (_view(x, call.k0, call.sk, call, b, keys=True) for x in (k, v))
            if call.mask is None:
                o_b, l_b = primitive.fused_forward(
                    backend, qv, kv, vv, scale=dim**-0.5, causal=call.causal
                )
            else:
                bias = _call_bias(plan, call, qv.shape[0], heads, q.device, q.dtype)
                o_b, l_b = primitive.masked_forward(backend, qv, kv, vv, bias, scale=dim**-0.5)
                if call.empty:  # rows without a key: out 0, lse -inf (the ops' lse is made up)
                    rows = _empty_rows(plan, index, q.device)
                    l_b.masked_fill_(rows[None, None, :], float("-inf"))
                    o_b.masked_fill_(rows[None, None, :, None], 0.0)
            if out is None:
                out = _adopt(o_b, q, call, b)
                if out is not None:  # the first call's output is the output: no copy
                    _lse_view(lse, call, b).copy_(l_b)
                    continue
                out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            _merge_(_view(out, call.q0, call.sq, call, b), _lse_view(lse, call, b), o_b, l_b)
            del o_b, l_b
    if out is None:  # no call (an empty sequence)
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    return out, lse.transpose(1, 2)


def _adopt(o_b: Tensor, q: Tensor, call: Call, b: int | None) -> Tensor | None:
    """o_b (N, H, sq, D) as the whole output (B, S, H, D) when its call covers every token of
    every batch row and the op laid it out (N, sq, H, D)-contiguous in q's dtype; else None."""
    adjacent = call.count == 1 or call.stride == call.sq
    covers = call.q0 == 0 and b is None and adjacent and call.sq * call.count == q.shape[1]
    if not covers or o_b.dtype != q.dtype:
        return None
    t = o_b.transpose(1, 2)
    return t.view(q.shape) if t.is_contiguous() else None


def _merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge a call's (out_b (N, H, sq, D), lse_b (N, H, sq)) into the views (out, lse) in
    place: out <- lerp(out, out_b, sigmoid(lse_b - lse)) in out's dtype, lse <- logaddexp.
    A row first met takes out_b exactly (lse -inf: weight 1); a row empty in both stays 0."""
    weight = (lse_b - lse).nan_to_num_(nan=0.0).sigmoid_()
    torch.logaddexp(lse, lse_b, out=lse)
    out.lerp_(out_b.to(out.dtype), weight.unsqueeze(-1).to(out.dtype))


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: BandPlan
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the accumulator dtype: each call's fused backward fed the final merged
    (out, lse (B, H, S) as `forward` returned it), added through the call's views."""
    bsz, seq_len, heads, dim = q.shape
    backend = primitive.backend_for(q.device, q.dtype)
    bias_dtype = primitive.accumulator_dtype(q.dtype) if backend == "cpu_flash" else q.dtype
    lse_s = lse.transpose(1, 2)  # (B, S, H)
    grads = primitive.zero_grads(q, k)
    for call in plan.calls:
        for b in _batch_rows(call, bsz, seq_len):
            qs = [_view(x, call.q0, call.sq, call, b) for x in (dout, q, out)]
            kv, vv = (_view(x, call.k0, call.sk, call, b, keys=True) for x in (k, v))
            lv = _lse_view(lse_s, call, b)
            if call.mask is None:
                parts = primitive.fused_backward(
                    backend, qs[0], qs[1], kv, vv, qs[2], lv, scale=dim**-0.5, causal=call.causal
                )
            else:
                bias = _call_bias(plan, call, qs[1].shape[0], heads, q.device, bias_dtype)
                parts = primitive.masked_backward(
                    backend, qs[0], qs[1], kv, vv, qs[2], lv, bias, scale=dim**-0.5
                )
            for grad, part, (start, length, keys) in zip(
                grads,
                parts,
                ((call.q0, call.sq, False), (call.k0, call.sk, True), (call.k0, call.sk, True)),
                strict=True,
            ):
                _view(grad, start, length, call, b, keys).add_(part)
            del parts
    return grads  # type: ignore[return-value]
