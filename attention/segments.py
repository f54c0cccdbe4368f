"""Where a LongNet branch's dilated rows are: segments, head groups and strided views of them.

A branch (w, r) cuts positions [lo, hi) into segments of w tokens from `lo`; the last segment
is shorter when hi - lo is not a multiple of w, and a segment longer than the range is the
whole range (the authors' code pads instead: see `attention.dilated`). Head group g (heads
[g * ceil(H / r), (g + 1) * ceil(H / r))) keeps the positions at offsets p = g, g + r, ... from
its segment's start: ceil((L - g) / r) rows of a segment of L tokens, fewer than the others for
the last offsets when r does not divide L. Rows of one group in consecutive segments of equal
length are one strided view (no copy) of a (B, S, H, D) tensor, so a primitive call takes a
chunk of segments as its batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

_HEAD_WINDOW: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "ringlab_head_window", default=None
)


@contextlib.contextmanager
def global_heads(first: int, total: int) -> Iterator[None]:
    """While open, a kernel's heads are heads [first, first + H) of `total` (Ulysses: a rank
    computes H / W of the model's heads), so LongNet's head groups follow the GLOBAL head
    index (`group_bounds`)."""
    token = _HEAD_WINDOW.set((first, total))
    try:
        yield
    finally:
        _HEAD_WINDOW.reset(token)


def head_window() -> tuple[int, int] | None:
    """The open `global_heads` window (first, total), None outside one."""
    return _HEAD_WINDOW.get()


def group_bounds(num_heads: int, rate: int) -> Iterator[tuple[int, int, int]]:
    """(offset g, first head, end head) of each non-empty head group of a branch of rate r:
    groups of ceil(H / r) heads, of the global heads inside `global_heads` (bounds then local
    to the kernel's H heads)."""
    first, total = head_window() or (0, num_heads)
    size = math.ceil(total / rate)
    for g in range(rate):
        h0, h1 = max(first, g * size), min(total, (g + 1) * size, first + num_heads)
        if h0 < h1:
            yield g, h0 - first, h1 - first


def offset_rows(length: int, offset: int, rate: int) -> int:
    """Rows at offsets offset, offset + rate, ... inside `length` tokens."""
    return max(0, (length - offset + rate - 1) // rate)


@dataclass(frozen=True)
class Rows:
    """One group's dilated rows in `count` segments: positions start + s*stride + i*rate for
    s < count, i < m (start already includes the group's offset), heads [h0, h1)."""

    start: int
    count: int
    stride: int
    rate: int
    m: int
    h0: int
    h1: int

    def of(self, x: torch.Tensor, b: int) -> torch.Tensor:
        """View (count, m, h1 - h0, D) of batch row b of x (B, S, H, D)."""
        sb, ss, sh, sd = x.stride()
        offset = x.storage_offset() + b * sb + self.start * ss + self.h0 * sh
        size = (self.count, self.m, self.h1 - self.h0, x.shape[3])
        return x.as_strided(size, (self.stride * ss, self.rate * ss, sh, sd), offset)

    def of_lse(self, lse: torch.Tensor, b: int) -> torch.Tensor:
        """View (count, h1 - h0, m) of batch row b of lse (B, H, S) matching `of`."""
        sb, sh, ss = lse.stride()
        offset = lse.storage_offset() + b * sb + self.h0 * sh + self.start * ss
        size = (self.count, self.h1 - self.h0, self.m)
        return lse.as_strided(size, (self.stride * ss, sh, self.rate * ss), offset)

    def pairs(self, causal: bool) -> int:
        """Query-key pairs per head of these rows (each segment's rows attend among themselves)."""
        per = self.m * (self.m + 1) // 2 if causal else self.m * self.m
        return self.count * per


def branch_rows(
    lo: int, hi: int, w: int, r: int, num_heads: int, *, chunk_tokens: int
) -> Iterator[Rows]:
    """The row sets of branch (w, r) over positions [lo, hi): whole segments of w tokens in
    chunks of at most max(1, chunk_tokens // w) segments, then the shorter last segment."""
    length = hi - lo
    full, tail = divmod(length, w)
    per_call = max(1, chunk_tokens // w)
    runs = [(lo + s0 * w, min(per_call, full - s0), w) for s0 in range(0, full, per_call)]
    if tail:
        runs.append((lo + full * w, 1, tail))
    for start, count, seg in runs:
        for g, h0, h1 in group_bounds(num_heads, r):
            m = offset_rows(seg, g, r)
            if m:
                yield Rows(start + g, count, w, r, m, h0, h1)


def branch_pairs(seq_len: int, num_heads: int, w: int, r: int, causal: bool) -> int:
    """Query-key pairs of branch (w, r) over a sequence, summed over heads."""
    rows = branch_rows(0, seq_len, w, r, num_heads, chunk_tokens=seq_len)
    return sum((x.h1 - x.h0) * x.pairs(causal) for x in rows)


def window_parts(rows: Rows, c0: int, c1: int) -> list[tuple[Rows, Rows, int]]:
    """`rows`' queries at positions [c0, c1) as (query rows, key rows, i0): the segments wholly
    inside as one part (queries and keys the same rows, i0 = 0), and each segment that a window
    edge cuts as a part of its own whose query rows are its rows i0 .. i1 - 1 inside the window
    (keys: all its rows; query i0 + i is row i of the query rows)."""
    m, rate, stride = rows.m, rows.rate, rows.stride
    first = max(0, -(-(c0 - rows.start - (m - 1) * rate) // stride))  # its last row >= c0
    last = min(rows.count - 1, (c1 - 1 - rows.start) // stride)  # its first row < c1
    if first > last:
        return []

    def segments(a: int, b: int) -> Rows:
        return replace(rows, start=rows.start + a * stride, count=b - a)

    def cut(s: int) -> tuple[int, int]:
        base = rows.start + s * stride
        i0 = min(m, max(0, -(-(c0 - base) // rate)))
        return i0, min(m, max(i0, -(-(c1 - base) // rate)))

    parts: list[tuple[Rows, Rows, int]] = []
    inner = [first, last + 1]
    for s in dict.fromkeys((first, last)):
        i0, i1 = cut(s)
        if (i0, i1) == (0, m):
            continue
        inner[0 if s == first else 1] = s + (s == first)
        if i1 > i0:
            seg = segments(s, s + 1)
            parts.append((replace(seg, start=seg.start + i0 * rate, m=i1 - i0), seg, i0))
    if inner[0] < inner[1]:
        whole = segments(*inner)
        parts.insert(0, (whole, whole, 0))
    return parts
