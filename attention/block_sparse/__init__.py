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

Two execution plans compute the same kept pairs (`plan`; "auto": by the inputs' device type,
attention.plans, a meta tensor by the type it stands for):
"cpu", many small calls sized for the CPU flash op (superblocks, stairs, rel views; below), and
"cuda", one FlexAttention call each way under a BlockMask built once per (pattern, length,
causal, device) and cached (attention.block_sparse.cuda), since a CUDA call costs its kernel
launches whatever its size. Either runs on either device (the CPU plan's primitive picks the
fused op by device; FlexAttention is compiled on CUDA, and on CPU under
RINGLAB_COMPILE_BACKEND, and runs eagerly elsewhere); the backend
string names the plan that ran.

Modules: params (the parameters, patterns and block mask), cpu_plan (the CPU plan's calls),
forward and backward (the CPU plan run), cuda (the CUDA plan) and kernel (the kernel and its
registration).
"""

from __future__ import annotations

from attention.block_sparse.kernel import BlockSparseAttention, cuda_head_dim_problem
from attention.block_sparse.params import (
    DEFAULT_SIZE,
    PATTERNS,
    BlockSparseParams,
    block_sparse_periods,
    check_block_sparse,
)
from attention.plans import PLANS, resolve_plan

__all__ = [
    "DEFAULT_SIZE",
    "PATTERNS",
    "PLANS",
    "BlockSparseAttention",
    "BlockSparseParams",
    "block_sparse_periods",
    "check_block_sparse",
    "cuda_head_dim_problem",
    "resolve_plan",
]
