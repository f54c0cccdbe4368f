"""The one primitive: attention of a query block against a key/value block as (out, lse), a stable
merge of partial results, and a FlashAttention-2 style backward that uses the final merged lse.

Layout everywhere: tensors (batch, seq, heads, head_dim); lse (batch, heads, seq), natural log of
the softmax denominator of the scaled scores. `out` and `lse` are accumulators in
`accumulator_dtype` (fp32; fp64 for fp64 inputs, so fp64 keeps fp64 accuracy).
Rows that see no key have out 0 and lse -inf; `merge` handles that without NaN.
Grouped-query attention: k and v may have fewer heads than q (H_kv dividing H); query head h
reads kv head h // (H / H_kv), and the backward returns dk, dv with H_kv heads.

Causal: query i sees key j <= i + diagonal (torch.tril's convention: diagonal 0 is top-left
aligned, Sk - Sq bottom-right). Every call is cut into `causal_pieces`: full rectangles and
squares with their own causal diagonal, the one causal shape on which every fused op agrees
(aten's CUDA flash op aligns a non-square causal mask bottom-right, the others top-left), so no
backend ever needs a materialized mask.

Backends (chosen once per (device type, dtype), recorded in `last_backend`):
- "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu and its fused backward.
- "cuda_flash" (fp16/bf16) / "cuda_efficient" (fp32): the CUDA SDPA aten ops that return lse, and
  their fused backward ops, fed the FINAL merged (out, lse) as ring-flash-attention feeds
  flash-attn's and PyTorch's context parallelism feeds these same ops.
- "math": plain matmul/softmax, only where no fused op exists (fp64 on CUDA, other devices).
The fused ops' lse carries no gradient: never let autograd see a merge; use `block_backward`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

BACKENDS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")

last_backend: str | None = None
"""Name of the backend the most recent `block_forward` call ran (for results to record)."""

_NEG_INF = float("-inf")
_MATH_CHUNK_ELEMENTS = 1 << 24  # score elements per chunk in the plain-math paths


@functools.cache
def _backend_for(device_type: str, dtype: torch.dtype) -> str:
    cpu_dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if device_type == "cpu" and dtype in cpu_dtypes:
        return "cpu_flash"
    if device_type == "cuda":
        if dtype in (torch.float16, torch.bfloat16):
            return "cuda_flash"
        if dtype == torch.float32:
            return "cuda_efficient"
    return "math"


_meta_stands_for: str | None = None
"""The device type a meta tensor stands for (`meta_stands_for`); None: meta runs "math"."""


@contextlib.contextmanager
def meta_stands_for(device_type: str) -> Iterator[None]:
    """Inside, meta tensors take the backend of `device_type` ("cpu" or "cuda"): the fused ops
    that device would call, through PyTorch's meta kernels of those ops, so that counting a
    kernel's calls, ops and bytes on the meta device (bench.plan) follows the branch the real
    device takes instead of the "math" path."""
    global _meta_stands_for
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type: expected 'cpu' or 'cuda', got {device_type!r}")
    before, _meta_stands_for = _meta_stands_for, device_type
    try:
        yield
    finally:
        _meta_stands_for = before


def device_type_of(device: torch.device | str) -> str:
    """The device type whose backend and plan a tensor on `device` takes (a meta tensor: the
    type `meta_stands_for` names, else "meta")."""
    kind = torch.device(device).type
    return _meta_stands_for if kind == "meta" and _meta_stands_for else kind


CUDA_FLASH_HEAD_DIM_MULTIPLE = 8
CUDA_FLASH_HEAD_DIM_MAX = 256
"""aten's CUDA flash op (fp16/bf16) checks head_dim % 8 == 0 (SDPA pads the last dim to a
multiple of 8 before calling it; this module calls it directly, unpadded) and head_dim <= 256
(SDPA's check_head_dim_size_flash and flash-attn 2's own limit)."""


def cuda_head_dim_problem(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the fused CUDA op this module calls for `dtype` cannot run `head_dim` (None when it
    can): the one rule for config validation and for a rank whose device resolved to CUDA.

    fp16/bf16 run aten's flash op: a multiple of 8, at most 256. fp32 runs the efficient op,
    for which torch documents no head_dim bound of its own (its kernels come aligned and
    unaligned): no rule is made up for it."""
    backend = _backend_for("cuda", dtype)
    if backend != "cuda_flash":
        return None
    if head_dim % CUDA_FLASH_HEAD_DIM_MULTIPLE or head_dim > CUDA_FLASH_HEAD_DIM_MAX:
        return (
            f"{head_dim} does not run on CUDA in {str(dtype).removeprefix('torch.')}: aten's "
            f"flash op, which this kernel calls directly, needs a multiple of "
            f"{CUDA_FLASH_HEAD_DIM_MULTIPLE} of at most {CUDA_FLASH_HEAD_DIM_MAX} "
            "(SDPA pads, the op does not); pick such a head_dim, or float32"
        )
    return None


def backend_for(device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend `block_forward` and `block_backward` use for this device type and dtype."""
    return _backend_for(device_type_of(device), dtype)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are kept and merged in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out 0, lse -inf) accumulators for q's rows: what rows no branch covers keep."""
    bsz, seq_len, heads, dim = q.shape
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(bsz, seq_len, heads, dim, dtype=acc, device=q.device)
    lse = torch.full((bsz, heads, seq_len), float("-inf"), dtype=acc, device=q.device)
    return out, lse


ACCUMULATOR_WINDOWS = 8
"""The most windows a merging kernel finishes its output in when the inputs are narrower than
the accumulator (bf16, fp16): only one window's rows are held in fp32 at a time, so the forward's
peak carries an eighth of an fp32 output (a sixteenth of the bf16 floor's per-element bytes)
instead of an fp32 output and its bf16 copy (1.5x the floor)."""


def windows(seq_len: int, dtype: torch.dtype, unit: int = 1) -> list[tuple[int, int]]:
    """Token ranges [c0, c1) whose rows `windowed_result` finishes one at a time: the whole
    sequence when `dtype` is its own accumulator dtype (the output is the accumulator), else
    at most ACCUMULATOR_WINDOWS ranges of equal whole numbers of `unit` tokens (the last one
    shorter): ceil(n / ACCUMULATOR_WINDOWS) units each, n = ceil(seq_len / unit)."""
    if accumulator_dtype(dtype) == dtype or seq_len <= unit:
        return [(0, seq_len)] if seq_len else []
    units = -(-seq_len // unit)
    size = -(-units // ACCUMULATOR_WINDOWS) * unit
    return [(c0, min(seq_len, c0 + size)) for c0 in range(0, seq_len, size)]


def windowed_result(
    q: torch.Tensor,
    fill: Callable[[int, int, torch.Tensor, torch.Tensor], None],
    spans: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse in the accumulator dtype) of a merging kernel, its rows computed
    window by window (`spans`, from `windows`, which the kernel may also plan by):
    `fill(c0, c1, out_w, lse_w)` merges the results of q's rows
    [c0, c1) into accumulators for those rows (out_w (B, c1 - c0, H, D), lse_w (B, H, c1 - c0),
    starting as `empty_result`'s 0 and -inf; row c0 is their row 0). A window done, its rows
    are cast into the output and the fp32 buffer serves the next window."""
    bsz, seq_len, heads, dim = q.shape
    acc = accumulator_dtype(q.dtype)
    if acc == q.dtype:
        out, lse = empty_result(q)
        for c0, c1 in spans:
            fill(c0, c1, out[:, c0:c1], lse[:, :, c0:c1])
        return out, lse
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((bsz, heads, seq_len), _NEG_INF, dtype=acc, device=q.device)
    most = max((c1 - c0 for c0, c1 in spans), default=0)
    buffer = torch.empty(bsz, most, heads, dim, dtype=acc, device=q.device)
    for c0, c1 in spans:
        out_w = buffer[:, : c1 - c0].zero_()
        fill(c0, c1, out_w, lse[:, :, c0:c1])
        out[:, c0:c1].copy_(out_w)
    return out, lse


def zero_grads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zeroed (dq, dk, dv) accumulators (dk, dv with k's heads)."""
    acc = accumulator_dtype(q.dtype)
    return (
        torch.zeros(q.shape, dtype=acc, device=q.device),
        torch.zeros(k.shape, dtype=acc, device=k.device),
        torch.zeros(k.shape, dtype=acc, device=k.device),
    )


def token_chunks(lo: int, hi: int, most: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into the fewest near-equal ranges of at most `most` tokens (none if empty):
    how kernels bound the tokens of one call."""
    if hi <= lo:
        return []
    count = -(-(hi - lo) // most)
    cuts = [lo + (hi - lo) * i // count for i in range(count + 1)]
    return list(itertools.pairwise(cuts))


def kv_head_pieces(
    h0: int, h1: int, num_heads: int, num_kv_heads: int, max_heads: int | None = None
) -> list[tuple[int, ...]]:
    """Query heads [h0, h1) cut into pieces (a0, a1, k0, k1) served by kv heads [k0, k1), so that
    a primitive call on q heads [a0, a1) and kv heads [k0, k1) maps each query head to its own kv
    head (GQA: head h reads kv head h // (num_heads / num_kv_heads)). One piece without GQA.
    `max_heads`: no piece holds more query heads (bounds a call's temporaries)."""
    group = num_heads // num_kv_heads
    if max_heads is not None:
        return [
            cut
            for piece in kv_head_pieces(h0, h1, num_heads, num_kv_heads)
            for cut in _cut_piece(*piece, group=group, max_heads=max(1, max_heads))
        ]
    pieces: list[tuple[int, ...]] = []
    h = h0
    while h < h1:
        kv = h // group
        if h % group == 0 and h1 - h >= group:
            whole = (h1 - h) // group
            pieces.append((h, h + whole * group, kv, kv + whole))
            h += whole * group
        else:
            end = min(h1, (kv + 1) * group)
            pieces.append((h, end, kv, kv + 1))
            h = end
    return pieces


def _cut_piece(
    a0: int, a1: int, k0: int, k1: int, *, group: int, max_heads: int
) -> list[tuple[int, ...]]:
    """A piece of kv_head_pieces cut to at most max_heads query heads (whole kv groups while a
    group fits, else heads of one kv head)."""
    if k1 - k0 > 1 and max_heads >= group:
        per = max_heads // group  # kv heads per cut
        return [
            (a0 + (c - k0) * group, a0 + (min(k1, c + per) - k0) * group, c, min(k1, c + per))
            for c in range(k0, k1, per)
        ]
    cuts = []
    for c in range(k0, k1):  # within one kv head at a time
        lo, hi = max(a0, c * group), min(a1, (c + 1) * group)
        cuts += [(h, min(hi, h + max_heads), c, c + 1) for h in range(lo, hi, max_heads)]
    return cuts


Piece = tuple[int, int, int, int, bool]
"""(q0, q1, k0, k1, causal): queries [q0, q1) against keys [k0, k1); causal only on a square,
where query q0 + t sees keys k0 .. k0 + t."""


@functools.lru_cache(maxsize=4096)
def causal_pieces(sq: int, sk: int, causal: bool, diagonal: int = 0) -> tuple[Piece, ...]:
    """Pieces whose union is what a (sq, sk) call computes: every pair, or when causal the pairs
    j <= i + diagonal. Rows [lo, hi) that see a prefix of the keys are a rectangle of the keys
    all of them see plus a causal square; rows [hi, sq) see every key; rows i < -diagonal see
    none and are in no piece. Two pieces' rows are equal or disjoint."""
    if not causal and diagonal:
        raise ValueError(f"diagonal: {diagonal} given without causal")
    if sq == 0 or sk == 0:  # no pair (the fused CPU op dies on zero keys; CUDA's lse is +inf)
        return ()
    if not causal:
        return ((0, sq, 0, sk, False),)
    lo = min(sq, max(0, -diagonal))
    hi = min(sq, max(lo, sk - diagonal))
    pieces: list[Piece] = []
    if lo < hi:
        if lo + diagonal > 0:
            pieces.append((lo, hi, 0, lo + diagonal, False))
        pieces.append((lo, hi, lo + diagonal, hi + diagonal, True))
    if hi < sq and sk > 0:
        pieces.append((hi, sq, 0, sk, False))
    return tuple(pieces)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"q, k, v: expected 4-D (batch, seq, heads, head_dim) with k and v equal, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]) or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q, k: batch and head_dim must match and k's heads divide q's, got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    diagonal: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, H, D) against k, v (B, Sk, H_kv, D): out (B,Sq,H,D), lse (B,H,Sq)
    in `accumulator_dtype`, except an out that one fused call produced: that one stays in the
    op's dtype (the inputs'), since converting it adds no precision, only a block-sized copy.
    Which of the two a call returns depends on its pieces, so callers `copy_` or `merge_` out
    into their accumulators and never rely on its dtype. `causal`: query i sees key
    j <= i + diagonal. No autograd graph.

    One fused call per `causal_pieces` piece; pieces of the same rows are merged. A tile
    under an arbitrary predicate: attention.masked_block.
    """
    global last_backend
    _check_shapes(q, k, v)
    sq = q.shape[1]
    backend = backend_for(q.device, q.dtype)
    last_backend = backend
    pieces = causal_pieces(sq, k.shape[1], causal, diagonal)
    with torch.no_grad():
        if pieces and pieces[0][:2] == (0, sq):  # every piece has all the rows: no buffer
            out, lse = _piece_forward(backend, q, k, v, scale, pieces[0])
            if len(pieces) > 1:
                out = out.to(lse.dtype)
            for piece in pieces[1:]:
                merge_(out, lse, *_piece_forward(backend, q, k, v, scale, piece))
            return out, lse
        out, lse = empty_result(q)
        seen: set[tuple[int, int]] = set()
        for piece in pieces:
            q0, q1 = piece[:2]
            o_b, l_b = _piece_forward(backend, q, k, v, scale, piece)
            o, lse_rows = out[:, q0:q1], lse[:, :, q0:q1]
            if (q0, q1) in seen:
                merge_(o, lse_rows, o_b, l_b)
            else:
                o.copy_(o_b)
                lse_rows.copy_(l_b)
                seen.add((q0, q1))
            del o_b, l_b
        return out, lse


def _piece_forward(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, piece: Piece
) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece's forward: (out, lse) of its rows; lse in the accumulator dtype, out in the
    fused op's dtype (the inputs'; the math path's: the accumulator dtype)."""
    q0, q1, k0, k1, causal = piece
    acc = accumulator_dtype(q.dtype)
    q, k, v = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1]
    if backend == "math":
        return _math_forward(q, k, v, scale, causal)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if backend == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse.to(acc)
    op, args, kwargs = _cuda_forward_args(backend, qt, kt, vt, scale, causal)
    res = op(*args, **kwargs)
    # the efficient op's lse is padded along Sq to a multiple of 32
    return res[0].transpose(1, 2), res[1][..., : q1 - q0].to(acc)


def _gqa_kv(backend: str, x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The (B, H_kv, S, D) K or V a fused CUDA op of `backend` takes: as it is for the flash op,
    which runs grouped heads natively (torch documents GQA for SDPA's flash and math kernels on
    CUDA, and SDPA's flash path hands the op K/V unrepeated); repeated to num_heads for the
    efficient op, which has no grouped heads (a copy of K/V per call: a strided view cannot map
    query head h to kv head h // G)."""
    return x if backend == "cuda_flash" else _repeat_kv(x, num_heads)


def _cuda_forward_args(
    backend: str, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, scale: float, causal: bool
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """(op, args, kwargs) of a fused CUDA forward on (B, H, S, D) views (kept apart so that a
    CPU test can check what a call allocates before the op)."""
    kt, vt = (_gqa_kv(backend, t, qt.shape[1]) for t in (kt, vt))
    if backend == "cuda_flash":
        op = torch.ops.aten._scaled_dot_product_flash_attention.default
        return op, (qt, kt, vt, 0.0, causal, False), {"scale": scale}
    if backend == "cuda_efficient":
        op = torch.ops.aten._scaled_dot_product_efficient_attention.default
        return op, (qt, kt, vt, None, True, 0.0, causal), {"scale": scale}
    raise ValueError(f"backend: {backend!r} has no fused CUDA forward")


def _math_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-math forward in the accumulator dtype (causal: top-left; `keep`: an explicit
    (Sq, Sk) predicate), chunked over query rows to bound the score matrix; GQA by repeating
    each kv head for its query heads."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    acc = accumulator_dtype(q.dtype)
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    qf, kf, vf = (t.to(acc).transpose(1, 2) for t in (q, k, v))
    kf, vf = (_repeat_kv(t, h) for t in (kf, vf))
    out = torch.empty(b, h, sq, q.shape[3], dtype=acc, device=q.device)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    step = max(1, _MATH_CHUNK_ELEMENTS // max(1, b * h * sk))
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        scores = (qf[:, :, s0:s1] @ kf.transpose(-1, -2)) * scale
        if keep is not None:
            scores.masked_fill_(~keep[..., s0:s1, :], _NEG_INF)
        chunk_lse = torch.logsumexp(scores, dim=-1)
        safe = chunk_lse.masked_fill(torch.isneginf(chunk_lse), math.inf)
        probs = torch.exp(scores - safe.unsqueeze(-1))
        out[:, :, s0:s1] = probs @ vf
        lse[:, :, s0:s1] = chunk_lse
    return out.transpose(1, 2), lse


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H, S, D), kv head j serving query heads j*G .. (j+1)*G - 1."""
    return x if x.shape[1] == num_heads else x.repeat_interleave(num_heads // x.shape[1], dim=1)


def _sum_kv(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) gradients of repeated kv heads summed back to (B, H_kv, S, D)."""
    b, h, s, d = x.shape
    if h == num_kv_heads:
        return x
    return x.view(b, num_kv_heads, h // num_kv_heads, s, d).sum(2)


def merge_(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial result b into (out, lse) in place; works on strided views.

    out: (..., S, H, D) and lse, lse_b: (..., H, S) in the accumulator dtype; out_b: (..., S,
    H, D) in it or in a narrower dtype (a fused op's output), read as it is. Returns (out, lse).
    out = (1 - w) out + w out_b with w = sigmoid(lse_b - lse): two in-place passes and no
    block-sized temporary (on CUDA; on CPU a narrower out_b is converted for the pass).
    """
    diff = (lse_b - lse).nan_to_num_(nan=0.0)  # -inf - -inf: both empty, weight irrelevant
    weight = torch.sigmoid_(diff).transpose(-1, -2).unsqueeze(-1)  # (..., S, H, 1)
    out.mul_(1 - weight).addcmul_(out_b, weight)
    lse.copy_(torch.logaddexp(lse, lse_b))
    return out, lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerically stable merge of two partial (out, lse) results; -inf rows merge without NaN."""
    acc = accumulator_dtype(out_a.dtype)
    return merge_(out_a.to(acc).clone(), lse_a.to(acc).clone(), out_b, lse_b)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    diagonal: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block pair in the accumulator dtype (dk, dv with k's
    heads), recomputing P = exp(S*scale - lse); `causal`, `diagonal` as in `block_forward`.

    `out` and `lse` are the FINAL (merged) results for these query rows, so summing the blocks'
    gradients gives the exact gradient of the merged attention (FlashAttention-2 backward).
    """
    _check_shapes(q, k, v)
    sq, sk = q.shape[1], k.shape[1]
    backend = backend_for(q.device, q.dtype)
    # Rows without any key: lse -inf -> +inf makes P = exp(S - inf) = 0 instead of NaN (and
    # is flash-attn's own convention for such rows).
    lse = lse.to(accumulator_dtype(q.dtype)).masked_fill(torch.isneginf(lse), math.inf)
    pieces = causal_pieces(sq, sk, causal, diagonal)
    with torch.no_grad():
        if len(pieces) == 1 and pieces[0][:4] == (0, sq, 0, sk):
            return _piece_backward(backend, dout, q, k, v, out, lse, scale, pieces[0])
        dq, dk, dv = zero_grads(q, k)
        for piece in pieces:
            q0, q1, k0, k1, _ = piece
            dq_b, dk_b, dv_b = _piece_backward(backend, dout, q, k, v, out, lse, scale, piece)
            dq[:, q0:q1] += dq_b
            dk[:, k0:k1] += dk_b
            dv[:, k0:k1] += dv_b
            del dq_b, dk_b, dv_b
        return dq, dk, dv


def _piece_backward(
    backend: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    piece: Piece,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One piece's fused backward: (dq of its rows, dk and dv of its keys), accumulator dtype:
    `fused_backward` on the piece's rows and keys as (B, H, S, D) views."""
    q0, q1, k0, k1, causal = piece
    rows, keys = slice(q0, q1), slice(k0, k1)
    views = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows])
    grads = fused_backward(
        backend, *(t.transpose(1, 2) for t in views), lse[:, :, rows], scale=scale, causal=causal
    )
    acc = accumulator_dtype(q.dtype)
    dq, dk, dv = (g.transpose(1, 2).to(acc) for g in grads)
    return dq, dk, dv


def _cuda_backward_args(
    backend: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[object, tuple, dict]:
    """(op, args, kwargs) of the fused CUDA backward op fed the final (out, lse), as its forward
    op's autograd and PyTorch's context parallelism call it: q, k, v, out and dout in the input
    dtype in the (B, H, S, D) layout of transposed (B, S, H, D) tensors; lse fp32 (B, H, Sq)
    and contiguous (the efficient op's padded along Sq to a multiple of 32, as its forward
    returns it); no dropout, so the philox arguments are placeholders in the forward's dtypes.
    GQA: the flash op takes the kv heads as they are (its dk, dv come back per kv head), the
    efficient op repeated ones, whose gradients the caller sums back. Kept apart so that a CPU
    test can check the arguments against the ops' schemas on the meta device."""
    dtype, device, h = q.dtype, q.device, q.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (_gqa_kv(backend, t.transpose(1, 2), h) for t in (k, v))
    # (B, S, H, D)-contiguous: the efficient kernel assumes out's row stride is H * D, unchecked
    dot, ot = (t.to(dtype).contiguous().transpose(1, 2) for t in (dout, out))
    sq, sk = q.shape[1], k.shape[1]
    lse32 = lse.to(torch.float32)
    if backend == "cuda_flash":
        seed = torch.empty(2, dtype=torch.uint64, device=device)
        offset = torch.empty((), dtype=torch.uint64, device=device)
        op = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
        args = (dot, qt, kt, vt, ot, lse32.contiguous(), None, None, sq, sk, 0.0, causal)
        return op, (*args, seed, offset), {"scale": scale}
    if backend == "cuda_efficient":
        padded = -(-sq // 32) * 32
        lse_p = torch.nn.functional.pad(lse32, (0, padded - sq), value=math.inf).contiguous()
        seed = torch.zeros((), dtype=torch.int64)  # its forward returns CPU scalars sans dropout
        offset = torch.zeros((), dtype=torch.int64)
        op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
        args = (dot, qt, kt, vt, None, ot, lse_p, seed, offset, 0.0, [True, True, True, False])
        return op, (*args, causal), {"scale": scale}
    raise ValueError(f"backend: {backend!r} has no fused CUDA backward")


def _math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-math FlashAttention-2 backward in the accumulator dtype (causal: top-left;
    `keep`: an explicit (Sq, Sk) predicate), chunked over query rows."""
    b, sq, h, _ = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    acc = accumulator_dtype(q.dtype)
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    qf, kf, vf, dof, of = (t.to(acc).transpose(1, 2) for t in (q, k, v, dout, out))
    kf, vf = (_repeat_kv(t, h) for t in (kf, vf))
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    step = max(1, _MATH_CHUNK_ELEMENTS // max(1, b * h * sk))
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        scores = (qf[:, :, s0:s1] @ kf.transpose(-1, -2)) * scale
        probs = torch.exp(scores - lse[:, :, s0:s1].unsqueeze(-1))
        if keep is not None:
            probs.masked_fill_(~keep[..., s0:s1, :], 0.0)
        do_c = dof[:, :, s0:s1]
        dv += probs.transpose(-1, -2) @ do_c
        dp = do_c @ vf.transpose(-1, -2)
        delta = (do_c * of[:, :, s0:s1]).sum(-1, keepdim=True)
        ds = probs * (dp - delta)
        dq[:, :, s0:s1] = (ds @ kf) * scale
        dk += (ds.transpose(-1, -2) @ qf[:, :, s0:s1]) * scale
    dk, dv = (_sum_kv(t, h_kv) for t in (dk, dv))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def fused_forward(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused forward call on (B, H, S, D) views (any strides, the last dimension dense):
    q (B, H, Sq, D), k, v (B, H_kv, Sk, D); causal only with Sq == Sk (a square: every op
    agrees). Returns out (B, H, Sq, D) in the inputs' dtype (the math path: the accumulator's)
    and lse (B, H, Sq) in the accumulator dtype. No autograd graph. Kernels that fold their
    blocks into the batch (dilated's cuda plan) call it directly, once per block shape."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal fused call needs a square, got {q.shape[2]} x {k.shape[2]}")
    acc = accumulator_dtype(q.dtype)
    with torch.no_grad():
        if backend == "cpu_flash":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale
            )
            return out, lse.to(acc)
        if backend == "math":
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
            out, lse = _math_forward(qs, ks, vs, scale, causal)
            return out.transpose(1, 2), lse
        op, args, kwargs = _cuda_forward_args(backend, q, k, v, scale, causal)  # GQA: _gqa_kv
        res = op(*args, **kwargs)
        lse = res[1] if backend == "cuda_flash" else res[1][..., : q.shape[2]]  # padded to 32
        return res[0], lse


def fused_backward(
    backend: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, ...]:
    """One fused backward call on (B, H, S, D) views as `fused_forward` takes them, fed the
    FINAL merged out (inputs' dtype) and lse (B, H, Sq) of these rows, every row of which sees
    a key (finite lse). Returns (dq, dk, dv) as (B, H, S, D) tensors (dk, dv with k's heads),
    in the op's dtype: the caller adds them into its accumulators."""
    if backend in ("cuda_flash", "cuda_efficient"):
        d_s, q_s, k_s, v_s, o_s = (t.transpose(1, 2) for t in (dout, q, k, v, out))
        op, args, kwargs = _cuda_backward_args(backend, d_s, q_s, k_s, v_s, o_s, lse, scale, causal)
        with torch.no_grad():
            grads = op(*args, **kwargs)  # type: ignore[operator]
        return grads[0], _sum_kv(grads[1], k.shape[1]), _sum_kv(grads[2], k.shape[1])
    acc = accumulator_dtype(q.dtype)
    dout, q, k, v, out = (t.to(acc) for t in (dout, q, k, v, out))
    with torch.no_grad():
        if backend == "cpu_flash":
            return tuple(
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
                )
            )
        d_s, q_s, k_s, v_s, o_s = (t.transpose(1, 2) for t in (dout, q, k, v, out))
        grads = _math_backward(d_s, q_s, k_s, v_s, o_s, lse, scale, causal)
        return tuple(g.transpose(1, 2) for g in grads)
