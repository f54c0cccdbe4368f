"""`block_sparse`'s CUDA plan, every pattern: FlexAttention, one fused call per forward and
its own one per backward, under a BlockMask built once per (pattern, length, causal, device)
and cached (flex_block_mask; flex_attention runs it).

Why FlexAttention: FlashAttention's fused ops take one dense rectangle (or causal square) per
call. A random pattern's kept blocks follow no offset rule, so a plan made of them must gather
each row's K/V blocks; at density 0.25 and 128K that is 256 GiB of gathered K/V (bf16, h16
d128) against a transient budget of 0.25x the 2 GiB floor, hence >= 512 calls whatever the
packing (the gathered plan this replaced made 1,040 / 2,080). The band patterns (local_window,
global_local) ran as chunk diagonals, strided fused calls of whole chunk pairs (6 and 8 calls
at 128K): a masked call computed the window's fringe whole (up to 3x the kept pairs), and the
backward's per-call gradients and (B, S, H, D)-contiguous dout and out over nearly every row
held 0.48x its floor in bf16 (0.85x with fp32 accumulators), against issue 37's quarter.
FlexAttention's kernel reads the kept tiles in place from the BlockMask's indices, skips the
others, and holds nothing beyond its outputs and lse.

The BlockMask (build_block_mask): tiles of `tile` tokens (the pattern's block, or on CUDA the
least common multiple of it and FLEX_TILE, the tile flex's kernels are tuned for). A
tile is "full" (no mask evaluated) when every block pair in it is kept, it lies wholly inside
the sequence and, causal, strictly below the diagonal; "partial" (mask_mod evaluated per token
pair) when it keeps some pair otherwise. mask_mod is the exact token rule everywhere (the kept
block, the key inside the sequence, causal), so the tiles only decide what is skipped.

How it runs (attention): compiled FlexAttention (attention.compiled's `block_sparse_plan`,
Triton kernels forward and backward) on a CUDA device, and on CPU when RINGLAB_COMPILE_BACKEND
names a backend (eager, aot_eager: Dynamo's guards and recompile limit as on a GPU). Elsewhere
(the plan forced on CPU by the tests, or meta for bench.plan) the same function eagerly: the
flex_attention higher-order op with its own autograd, since torch's public flex_attention
refuses inputs that require grad on CPU (its _validate_device: "FlexAttention does not support
backward on CPU"), though the op's eager forward and backward (the unfused math reference,
which materializes the (B, H, S, S) scores and applies mask_mod to every pair) are exact there.
That eager math ignores the tiles, so tests check the tiles against the block mask apart
(tile_pairs). bench.plan counts each of the op's forward and backward as one fused call.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as flex

from attention import compiled, primitive
from attention.block_sparse.params import BlockSparseParams, _cached_block_mask

FLEX_TILE = 128
"""On CUDA a tile holds at least this many tokens (flex's default BLOCK_SIZE, which its kernels'
BLOCK_M / BLOCK_N divide); elsewhere a tile is the pattern's block."""


FLEX_MIN_HEAD_DIM = 16
"""The least head_dim FlexAttention's compiled CUDA kernels take (Inductor's lowering: "NYI:
embedding dimension of the query, key, and value must be at least 16"; tl.dot's limit)."""


def head_dim_problem(head_dim: int) -> str | None:
    """Why compiled FlexAttention cannot run `head_dim` on CUDA (None when it can)."""
    if head_dim >= FLEX_MIN_HEAD_DIM:
        return None
    return (
        f"{head_dim} does not run on CUDA: compiled FlexAttention (Triton's tl.dot) needs at "
        f"least {FLEX_MIN_HEAD_DIM}; pick a head_dim of {FLEX_MIN_HEAD_DIM} or more"
    )


def tile_size(block_size: int, device_type: str) -> int:
    """Tokens of one BlockMask tile for `block_size` blocks on `device_type` (module docstring):
    on CUDA the least common multiple of the block and FLEX_TILE, since a tile must hold whole
    blocks and Inductor's kernels need their BLOCK_M / BLOCK_N (64 or 128) to divide it ("Q and
    KV block size must be divisible by BLOCK_M and BLOCK_N"; 48-token blocks in 144-token tiles
    would not compile)."""
    if device_type != "cuda":
        return block_size
    return math.lcm(block_size, FLEX_TILE)


def _tiles(keep: Tensor, seq_len: int, bs: int, causal: bool, tile: int) -> tuple[Tensor, ...]:
    """(padded, full, partial): `keep` (n, n; causal trimmed here) padded with dropped blocks
    to whole tiles, and bool (T, T) full and partial tiles (module docstring)."""
    per = tile // bs
    count = -(-seq_len // tile)
    n = keep.shape[0]
    padded = torch.zeros(count * per, count * per, dtype=torch.bool)
    padded[:n, :n] = keep.tril() if causal else keep
    blocks = padded.view(count, per, count, per).transpose(1, 2)  # (T, T, per, per)
    kept, whole = blocks.any((2, 3)), blocks.all((2, 3))
    inside = torch.arange(count) < seq_len // tile  # tiles wholly inside the sequence
    whole &= inside[:, None] & inside[None, :]
    if causal:
        whole &= torch.ones(count, count, dtype=torch.bool).tril(-1)
    return padded, whole, kept & ~whole


def _indices(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks (1, 1, T), indices (1, 1, T, T)) int32 of bool (T, T) tiles: each row's kept
    tile columns first, ascending (the BlockMask layout)."""
    order = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices
    count = tiles.sum(-1)
    return count.to(torch.int32)[None, None], order.to(torch.int32)[None, None]


def build_block_mask(
    keep: Tensor, seq_len: int, bs: int, causal: bool, tile: int, device: torch.device
) -> flex.BlockMask:
    """The BlockMask of block mask `keep` (n, n bool, blocks of `bs` tokens) at `seq_len` tokens,
    causal or not, in tiles of `tile` tokens (a multiple of bs), on `device`. Its mask_mod
    holds the padded block mask on `device` (built once here: callers cache the result)."""
    padded, full, partial = _tiles(keep, seq_len, bs, causal, tile)
    table = padded.to(device)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        kept = table[q_idx // bs, kv_idx // bs] & (kv_idx < seq_len)
        return kept & (q_idx >= kv_idx) if causal else kept

    kv_num, kv_idx = _indices(partial)
    full_num, full_idx = _indices(full)
    mask = flex.BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )  # fmt: skip
    return mask.to(device)


def tile_pairs(mask: flex.BlockMask, seq_len: int, transposed: bool = False) -> Tensor:
    """int64 (S, S): how the tiles of `mask` cover each token pair, as its CUDA kernel reads
    them: 2 where a full tile holds it, 1 where a partial tile holds it and mask_mod keeps it,
    0 otherwise; `transposed` reads the backward's (query-major) tile lists instead. A pair the
    block mask keeps must read 1 or 2, any other 0 (the tests' check of the tiles)."""
    tile = mask.BLOCK_SIZE[0]
    count = -(-seq_len // tile)
    kinds: list[Tensor] = []
    fields = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    if not transposed:
        fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    for num, idx in (fields[:2], fields[2:]):
        nums, cols = getattr(mask, num)[0, 0].cpu(), getattr(mask, idx)[0, 0].cpu()
        grid = torch.zeros(count, count, dtype=torch.int64)
        for row in range(count):
            grid[row, cols[row, : int(nums[row])].long()] = 1
        kinds.append(grid.T if transposed else grid)
    partial, full = (g.repeat_interleave(tile, 0).repeat_interleave(tile, 1) for g in kinds)
    pos = torch.arange(count * tile)
    rule = mask.mask_mod(torch.tensor(0), torch.tensor(0), pos[:, None], pos[None, :])
    pairs = 2 * full + partial * rule.cpu().long()
    return pairs[:seq_len, :seq_len]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: flex.BlockMask) -> Tensor:
    """Attention of (B, S, H, D) q against (B, S, H_kv, D) k, v under `mask`, with autograd:
    the compiled kernel `block_sparse_plan` (attention.compiled) where a compile backend
    applies (CUDA; CPU under RINGLAB_COMPILE_BACKEND), else the same function eagerly (the
    flex_attention op; module docstring). Returns (B, S, H, D) in q's dtype."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    chosen = compiled.backend(q.device.type)
    if chosen is None:
        out = compiled.block_sparse_plan(qt, kt, vt, mask)
    else:
        out = compiled.KERNELS["block_sparse_plan"](chosen, qt, kt, vt, mask)
    return out.transpose(1, 2)


def compiles(device: torch.device) -> bool:
    """Whether `attention` runs compiled on `device` (attention.compiled.backend)."""
    return compiled.backend(device.type) is not None


def backend(device: torch.device) -> str:
    """What `attention` runs on `device`: "flex-compiled" or "flex-eager"."""
    return "flex-compiled" if compiles(device) else "flex-eager"


@functools.lru_cache(maxsize=16)
def flex_block_mask(
    params: BlockSparseParams, seq_len: int, causal: bool, device: torch.device, tile: int
) -> flex.BlockMask:
    """The BlockMask of the cached block mask on `device` in tiles of `tile` tokens, built
    once per (params, length, causal, device, tile): forward and backward copy nothing to the
    device."""
    mask = _cached_block_mask(params, seq_len)
    return build_block_mask(mask, seq_len, params.block_size, causal, tile, device)


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: BlockSparseParams, causal: bool
) -> torch.Tensor:
    """block_sparse under the CUDA plan: FlexAttention under the cached BlockMask, one fused
    call forward and one backward (its own autograd)."""
    tile = tile_size(params.block_size, primitive.device_type_of(q.device))
    mask = flex_block_mask(params, q.shape[1], causal, q.device, tile)
    return attention(q, k, v, mask)
