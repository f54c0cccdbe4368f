"""Explicit token masks and dense masked attention: the slow references kernels are tested against.

Everything here materialises (S, S) masks and scores in fp64-capable plain torch ops (einsum,
logsumexp, softmax) with autograd, independent of the primitive; use it for tests only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attention.mask import Documents

_BIG_NEG = -1e30  # finite "minus infinity": keeps autograd free of inf - inf NaNs


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """keep[i, j] = j <= i."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def dilated_branch_mask(
    seq_len: int,
    num_heads: int,
    segment_length: int,
    dilation_rate: int,
    *,
    causal: bool = False,
    rows: tuple[int, int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """LongNet branch (w, r) as keep (H, S, S), from the definition (authors' semantics).

    Segments of w tokens; heads split into r contiguous groups of ceil(H / r) heads; head h is in
    group g = h // ceil(H / r) and, in every segment, keeps the positions p (from the segment
    start) with p % r == g; kept positions of one segment attend among themselves.
    Segments tile from position 0: when S % w != 0 the last one is shorter, and w > S makes the
    whole sequence one segment (no padding exists, so none is attended).
    `rows` (c0, c1): only the query rows c0 .. c1 - 1, as (H, c1 - c0, S); a 1-D tensor: only
    the query rows at those positions, as (H, len(rows), S).
    """
    pos = torch.arange(seq_len)
    rows_pos = _row_positions(pos, rows)
    segment = pos // segment_length
    offset = pos % segment_length
    group_size = math.ceil(num_heads / dilation_rate)
    group = torch.arange(num_heads) // group_size  # (H,)
    kept = (offset % dilation_rate)[None, :] == group[:, None]  # (H, S)
    same_segment = segment[rows_pos, None] == segment[None, :]  # (rows, S)
    keep = kept[:, rows_pos, None] & kept[:, None, :] & same_segment[None]
    if causal:
        keep &= (pos[None, :] <= rows_pos[:, None])[None]
    return keep


def _row_positions(pos: torch.Tensor, rows: tuple[int, int] | torch.Tensor | None) -> torch.Tensor:
    """The query positions `rows` names: all, a (c0, c1) range, or a tensor of positions."""
    if rows is None:
        return pos
    if isinstance(rows, torch.Tensor):
        return rows.to(pos.device, torch.int64)
    return pos[slice(*rows)]


def block_token_mask(
    block_mask: torch.Tensor, block_size: int, *, causal: bool = False, seq_len: int | None = None
) -> torch.Tensor:
    """Token keep-mask (S, S) or (H, S, S) of a block mask (n, n) or (H, n, n); causal optional.
    `seq_len` < n * block_size: the last block is short (its tokens beyond seq_len do not exist)."""
    keep = block_mask.repeat_interleave(block_size, -1).repeat_interleave(block_size, -2)
    if seq_len is not None:
        keep = keep[..., :seq_len, :seq_len]
    if causal:
        keep = keep & causal_mask(keep.shape[-1], keep.device)
    return keep


def causal_rows(keep: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """keep (..., len(rows), S) restricted to keys at or before each query row."""
    keys = torch.arange(keep.shape[-1], device=keep.device)
    return keep & (keys[None, :] <= rows.to(keep.device)[:, None])


def block_token_rows(
    block_mask: torch.Tensor, block_size: int, rows: torch.Tensor, seq_len: int, causal: bool
) -> torch.Tensor:
    """The rows `rows` of block_token_mask(block_mask, block_size, causal=causal,
    seq_len=seq_len), (len(rows), S) or (H, len(rows), S), without the (S, S) mask."""
    keys = torch.arange(seq_len, device=rows.device)
    keep = block_mask.to(rows.device)[..., rows // block_size, :][..., keys // block_size]
    return causal_rows(keep, rows) if causal else keep


def document_rows(lengths: Sequence[int], rows: torch.Tensor, causal: bool) -> torch.Tensor:
    """The rows `rows` of the packed documents' mask (attention.documents.document_mask):
    (len(rows), S), a query attending to the keys of its own document."""
    return Documents(tuple(lengths), causal).rows(rows, sum(lengths))


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention restricted to `keep` (S, S) or (H, S, S): out (B,S,H,D), lse (B,H,S).
    k and v may have fewer heads than q (grouped-query attention).

    Rows with no kept key output 0; their lse is `_BIG_NEG`-like (finite) so that merging by
    softmax over lse gives them no weight and autograd stays NaN-free.

    Keys that no row keeps carry no weight and are left out of the scores: a few query rows of
    a local kernel (a segment, a window) then cost their own keys, not the whole sequence.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = keep.to(q.device)
    cols = keep.reshape(-1, keep.shape[-1]).any(0).nonzero().flatten()
    if 0 < len(cols) < keep.shape[-1]:
        k, v, keep = k.index_select(1, cols), v.index_select(1, cols), keep.index_select(-1, cols)
    if k.shape[2] != q.shape[2]:  # grouped-query: kv head j serves query heads j*G .. (j+1)*G-1
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~keep, _BIG_NEG)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)) * keep
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def dilated_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    rows: tuple[int, int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """LongNet dilated attention: per-branch masked softmax, branches mixed by softmax of lse.

    A (head, position) a branch does not cover gets no weight from it; covered by none -> 0.
    `rows` (c0, c1): q holds only the query rows c0 .. c1 - 1 of the sequence of k and v; a
    1-D tensor: q holds the query rows at those positions.
    """
    seq_len, num_heads = k.shape[1], q.shape[2]
    outs, lses, covered = [], [], []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        keep = dilated_branch_mask(seq_len, num_heads, w, r, causal=causal, rows=rows)
        out, lse = masked_attention(q, k, v, keep)
        outs.append(out)
        lses.append(lse)
        covered.append(keep.any(-1))  # (H, S)
    cov = torch.stack(covered)  # (n, H, S)
    lse = torch.stack(lses).masked_fill(~cov[:, None], _BIG_NEG)  # (n, B, H, S)
    weights = torch.softmax(lse, dim=0) * cov[:, None]  # (n, B, H, S)
    mixed = sum(o * wt.transpose(1, 2).unsqueeze(-1) for o, wt in zip(outs, weights, strict=True))
    return mixed
