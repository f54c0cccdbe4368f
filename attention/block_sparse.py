"""`block_sparse`: attention restricted to a block mask, computing only the kept block pairs.

The sequence is cut into blocks of `block_size` tokens; `block_mask(seq_len)` (n, n) says which
key blocks each query block attends to. Patterns (i: query block, j: key block):
- local_window: |i - j| <= window;
- dilated: (i - j) % dilation == 0 and |i - j| <= window * dilation;
- global_local: |i - j| <= window, or i < num_global, or j < num_global;
- random: the diagonal plus num_random other key blocks per row, drawn with `seed`.
Either sparsity_ratio (the fraction of key blocks a query block computes) or the pattern's size
parameter (window; num_random for random) is given, never both (neither: the size is
DEFAULT_SIZE, 1). From sparsity_ratio the size
parameter is the one whose mask density is nearest; density then lies within 1/n (one block per
row) of the ratio, else ValueError. The diagonal is always kept; causal intersects the mask with
the lower triangle and masks tokens causally inside diagonal blocks. window and num_global larger
than the number of blocks mean "all blocks".

A length that is not a multiple of block_size ends in a shorter last block (ceil(S / bs)
blocks); the mask is the pattern's on those blocks and the short block holds only real tokens,
so no padding exists to be attended. k and v may have fewer heads than q (grouped-query).
Inputs narrower than fp32 (bf16, fp16) are finished in accumulator windows of query blocks
(primitive.windowed_result), so only one window's rows are held in fp32.

Two execution plans compute the same kept pairs (`plan`; "auto": by the inputs' device type):
"cpu", many small calls sized for the CPU flash op (superblocks, stairs, rel views; below), and
"cuda", one FlexAttention call each way under a BlockMask built once per (pattern, length,
causal, device) and cached (attention.block_sparse_flex), since a CUDA call costs its kernel
launches whatever its size. Either runs on either device (the CPU plan's primitive picks the
fused op by device; FlexAttention is compiled on CUDA, and on CPU under
RINGLAB_COMPILE_BACKEND, and runs eagerly elsewhere); the backend
string names the plan that ran.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch

from attention import block_sparse_flex, primitive
from attention.autograd import merged_attention
from attention.base import MergedKernel, attention_flops, check_qkv
from attention.errors import ParamError
from attention.hilbert import check_hilbert_length, check_ordering, in_order
from attention.primitive import (
    block_backward,
    block_forward,
    merge_,
    zero_grads,
)
from attention.registry import KernelSpec, register

PATTERNS = ("local_window", "dilated", "global_local", "random")
PLANS = ("auto", "cpu", "cuda")
_PATTERN_FIELDS = {
    "local_window": ("window",),
    "dilated": ("window", "dilation"),
    "global_local": ("window", "num_global"),
    "random": ("num_random", "seed"),
}
_SIZE_FIELD = {"local_window": "window", "dilated": "window", "global_local": "window"}
_SIZE_FIELD["random"] = "num_random"
_OPTIONAL_FIELDS = ("window", "dilation", "num_global", "num_random", "seed")
DEFAULT_SIZE = 1
"""The pattern's size parameter (window, or num_random for random) when neither it nor
sparsity_ratio is given: one block each side (one random block), valid at every length, so
`attention.build("block_sparse")` runs as is."""
MAX_VIEW_RUNS = 2
"""A query block whose kept key blocks form more contiguous runs than this gathers them."""
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
CALL_ROW_HEADS = 6144
"""Bound on rows x heads of one backward call's temporaries (see _backward_split)."""
BACKWARD_KEY_TOKENS = 512
"""Bound on the key tokens of one backward call (see _key_parts)."""
BACKWARD_QUERY_TOKENS = 512
"""Bound on the query tokens of one backward call: the CPU flash op's backward takes a buffer
of 1 MiB per thread from 768 queries, 256 KiB below (FlashAttentionKernel.cpp)."""


def _check_int(field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ParamError(f"params.{field}", f"expected an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class BlockSparseParams:
    """block_size, pattern, and sparsity_ratio or the pattern's own parameters; token ordering.

    Fields a pattern does not use must stay unset (None): setting them is an error. With
    neither sparsity_ratio nor the pattern's size parameter, the size is DEFAULT_SIZE.
    """

    block_size: int = 64
    pattern: str = "local_window"
    sparsity_ratio: float | None = None
    window: int | None = None
    dilation: int | None = None
    num_global: int | None = None
    num_random: int | None = None
    seed: int | None = None
    ordering: str = "natural"
    plan: str = "auto"
    """Execution plan: "cpu" (many small calls tuned to the CPU flash op), "cuda" (one
    FlexAttention call each way under a cached BlockMask) or "auto" (by the inputs' device
    type)."""

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.pattern not in PATTERNS:
            raise ParamError(
                "params.pattern", f"must be one of {', '.join(PATTERNS)}, got {self.pattern!r}"
            )
        used = _PATTERN_FIELDS[self.pattern]
        for field in _OPTIONAL_FIELDS:
            value = getattr(self, field)
            if value is None:
                continue
            if field not in used:
                raise ParamError(
                    f"params.{field}",
                    f"not used by pattern {self.pattern!r} (it uses "
                    f"{', '.join(used)} and sparsity_ratio)",
                )
            _check_int(field, value, 1 if field == "dilation" else 0)
        size = _SIZE_FIELD[self.pattern]
        if self.sparsity_ratio is not None:
            ratio = self.sparsity_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
                raise ParamError("params.sparsity_ratio", f"must be in (0, 1], got {ratio!r}")
            if getattr(self, size) is not None:
                raise ParamError(
                    f"params.{size}",
                    f"conflicts with params.sparsity_ratio; pattern "
                    f"{self.pattern!r} takes one of them",
                )
        elif getattr(self, size) is None:  # neither given: the default size (frozen: set here)
            object.__setattr__(self, size, DEFAULT_SIZE)
        check_ordering(self.ordering)
        if self.plan not in PLANS:
            raise ParamError("params.plan", f"must be one of {', '.join(PLANS)}, got {self.plan!r}")


def resolve_plan(plan: str, device: torch.device) -> str:
    """The plan that runs: `plan`, or for "auto" "cuda" on a CUDA device and "cpu" elsewhere."""
    if plan != "auto":
        return plan
    return "cuda" if device.type == "cuda" else "cpu"


def _pattern_mask(params: BlockSparseParams, n: int, size: int) -> torch.Tensor:
    """Block keep-mask (n, n) of the pattern with size parameter `size` (window or num_random).

    Built on a rank at run time only; submit-time checks count its pairs in closed form
    (`_kept_pairs`). A window or dilation beyond n blocks means the same as n (all blocks
    within reach), so both are clamped before they meet int64 tensors."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    dist = (i - j).abs()
    size = min(size, n)
    if params.pattern == "local_window":
        return dist <= size
    if params.pattern == "dilated":
        d = min(params.dilation if params.dilation is not None else 2, n)
        return (dist % d == 0) & (dist <= size * d)
    if params.pattern == "global_local":
        g = min(params.num_global if params.num_global is not None else 1, n)
        return (dist <= size) | (i < g) | (j < g)
    # random: the diagonal ranks first, then a seeded random order of the other blocks
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    score = torch.rand(n, n, generator=gen)
    score.fill_diagonal_(2.0)
    top = score.topk(min(n, size + 1), dim=-1).indices
    return torch.zeros(n, n, dtype=torch.bool).scatter_(1, top, True)


def _band_pairs(m: int, reach: int, step: int = 1) -> int:
    """Pairs (i, j) of an m x m grid with |i - j| a multiple of `step` and at most
    reach x step: the diagonal plus two bands per kept offset k x step (m - k x step each)."""
    if m <= 0:
        return 0
    k = min(reach, (m - 1) // step)
    return m * (2 * k + 1) - step * k * (k + 1)


def _kept_pairs(params: BlockSparseParams, n: int, size: int) -> int:
    """The number of True entries of `_pattern_mask(params, n, size)`, from the pattern's
    formula in O(1) (Python ints: any n, any size), so a check never builds the mask."""
    if params.pattern == "local_window":
        return _band_pairs(n, size)
    if params.pattern == "dilated":
        return _band_pairs(n, size, params.dilation if params.dilation is not None else 2)
    if params.pattern == "global_local":
        g = min(n, params.num_global if params.num_global is not None else 1)
        return g * n + (n - g) * g + _band_pairs(n - g, size)
    return n * min(n, size + 1)  # random: the diagonal and `size` others per row


def _density(params: BlockSparseParams, n: int, size: int) -> Fraction:
    """The mask's exact density (kept pairs / n^2)."""
    return Fraction(_kept_pairs(params, n, size), n * n)


def _size_for_ratio(params: BlockSparseParams, n: int, ratio: float) -> int:
    """The size parameter whose mask density is nearest to `ratio` (ties: the smaller),
    by bisection over the closed-form density (exact rationals, O(log n) steps)."""
    if params.pattern == "random":
        return max(0, min(n, math.floor(ratio * n + 0.5)) - 1)
    target = Fraction(ratio)
    lo, hi = 0, n  # densities grow with the window; find the first window reaching the ratio
    while lo < hi:
        mid = (lo + hi) // 2
        if _density(params, n, mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    if lo > 0 and abs(_density(params, n, lo - 1) - target) <= abs(
        _density(params, n, lo) - target
    ):
        return lo - 1
    return lo


def _pattern_size(params: BlockSparseParams, seq_len: int) -> int:
    """The pattern's size parameter at `seq_len`: the given one, or the one nearest to
    sparsity_ratio, which must lie within one block per row (1/n) of it (else ParamError)."""
    n = -(-seq_len // params.block_size)
    if params.sparsity_ratio is None:
        return int(getattr(params, _SIZE_FIELD[params.pattern]))
    size = _size_for_ratio(params, n, params.sparsity_ratio)
    got = _density(params, n, size)
    if abs(got - Fraction(params.sparsity_ratio)) > Fraction(1, n) + Fraction(1, 10**9):
        raise ParamError(
            "params.sparsity_ratio",
            f"pattern {params.pattern!r} cannot reach density "
            f"{params.sparsity_ratio} within one block per row at seq_len {seq_len} "
            f"({n} blocks); nearest is {float(got):.4f}",
        )
    return size


@functools.lru_cache(maxsize=64)
def _cached_block_mask(params: BlockSparseParams, seq_len: int) -> torch.Tensor:
    """The (n, n) mask a rank computes with (run time only: O(n^2) memory)."""
    n = -(-seq_len // params.block_size)
    return _pattern_mask(params, n, _pattern_size(params, seq_len))


def block_sparse_periods(params: BlockSparseParams) -> tuple[int, ...]:
    """The gate's token periods: the block, and a window pattern's span in tokens when the
    pattern gives its size (with sparsity_ratio the window follows the length, so only the
    run's own length shows it: the gate's sampled check)."""
    periods = [params.block_size]
    size = getattr(params, _SIZE_FIELD[params.pattern])
    if size is not None and params.pattern != "random":
        dilation = params.dilation if params.dilation is not None else 1
        periods.append(params.block_size * (size * dilation + 1))
    if params.num_global:
        periods.append(params.block_size * params.num_global)
    return tuple(periods)


def check_block_sparse(
    params: BlockSparseParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Raise ValueError unless seq_len is a power of 4 under hilbert and the sparsity_ratio is
    reachable at that length (any length otherwise: the last block may be shorter)."""
    if params.ordering == "hilbert":
        check_hilbert_length(seq_len)
    _pattern_size(params, seq_len)  # closed form: a submit never builds the (n, n) mask


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


@functools.lru_cache(maxsize=16)
def flex_block_mask(
    params: BlockSparseParams, seq_len: int, causal: bool, device: torch.device, tile: int
) -> block_sparse_flex.flex.BlockMask:
    """The BlockMask of the cached block mask on `device` in tiles of `tile` tokens, built
    once per (params, length, causal, device, tile): forward and backward copy nothing to the
    device."""
    mask = _cached_block_mask(params, seq_len)
    return block_sparse_flex.build_block_mask(
        mask, seq_len, params.block_size, causal, tile, device
    )


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: BlockSparseParams, causal: bool
) -> torch.Tensor:
    """block_sparse under the CUDA plan: FlexAttention under the cached BlockMask, one fused
    call forward and one backward (its own autograd)."""
    tile = block_sparse_flex.tile_size(params.block_size, primitive.device_type_of(q.device))
    mask = flex_block_mask(params, q.shape[1], causal, q.device, tile)
    return block_sparse_flex.attention(q, k, v, mask)


def cuda_head_dim_problem(
    params: BlockSparseParams, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why block_sparse with `params` cannot run `head_dim` on CUDA: the cuda plan (auto's on
    CUDA) runs compiled FlexAttention, the cpu plan the primitive's fused ops."""
    if resolve_plan(params.plan, torch.device("cuda")) == "cuda":
        return block_sparse_flex.head_dim_problem(head_dim)
    return primitive.cuda_head_dim_problem(dtype, head_dim)


class BlockSparseAttention(MergedKernel):
    """Attention over (B, S, H, D) restricted to `block_mask`; see the module docstring."""

    chunk_tokens = CHUNK_TOKENS

    def __init__(self, params: BlockSparseParams) -> None:
        super().__init__()
        self.params = params

    @property
    def window_unit(self) -> int:
        """Accumulator windows are whole query blocks."""
        return self.params.block_size

    def block_mask(self, seq_len: int, *, causal: bool = False) -> torch.Tensor:
        """bool (n_blocks, n_blocks): key blocks each query block computes (on permuted
        positions under hilbert ordering); causal intersects it with the lower triangle."""
        check_block_sparse(self.params, seq_len=seq_len)
        mask = _cached_block_mask(self.params, seq_len).clone()
        return mask.tril() if causal else mask

    def compiles(self, device: torch.device) -> bool:
        """Whether a forward on `device` runs a compiled kernel: the cuda plan, compiled there
        (attention.block_sparse_flex.compiles)."""
        plan = resolve_plan(self.params.plan, device)
        return plan == "cuda" and block_sparse_flex.compiles(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        check_block_sparse(self.params, seq_len=q.shape[1], num_heads=q.shape[2])
        plan = resolve_plan(self.params.plan, q.device)
        self.plan = plan
        if plan == "cuda":
            self.backend = f"{block_sparse_flex.backend(q.device)}-plan-cuda"
            run = functools.partial(flex_attention, params=self.params, causal=causal)
            return in_order(self.params.ordering, run, q, k, v)
        self.backend = f"{primitive.backend_for(q.device, q.dtype)}-plan-cpu"
        fwd = functools.partial(block_sparse_forward, params=self.params, causal=causal)
        bwd = functools.partial(block_sparse_backward, params=self.params, causal=causal)
        return in_order(
            self.params.ordering, lambda q, k, v: merged_attention(q, k, v, fwd, bwd), q, k, v
        )

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        """Token pairs of the kept block pairs (diagonal blocks: the causal triangle when
        causal; the short last block counts its own tokens)."""
        bs = self.params.block_size
        mask = self.block_mask(seq_len, causal=causal)
        sizes = torch.full((mask.shape[0],), bs, dtype=torch.int64)
        sizes[-1] = seq_len - (mask.shape[0] - 1) * bs
        off_diag = mask.clone().fill_diagonal_(False)
        pairs = int((sizes[:, None] * sizes[None, :] * off_diag).sum())
        pairs += int((sizes * (sizes + 1) // 2 if causal else sizes * sizes).sum())
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)


register(
    KernelSpec(
        name="block_sparse",
        primitive=True,
        description=(
            "Block-sparse attention (local_window, dilated, global_local or random block "
            "pattern); computes only the kept block pairs."
        ),
        params=BlockSparseParams,
        factory=BlockSparseAttention,
        check=check_block_sparse,
        periods=block_sparse_periods,
        cuda_head_dim=cuda_head_dim_problem,
    )
)
