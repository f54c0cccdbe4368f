"""The block_sparse kernel: BlockSparseAttention, which runs the CPU plan (forward, backward)
or the CUDA plan (cuda) by `plan`, and its registration."""

from __future__ import annotations

import functools

import torch

from attention import primitive
from attention.autograd import merged_attention
from attention.base import MergedKernel, attention_flops, check_qkv
from attention.block_sparse import cuda
from attention.block_sparse.backward import block_sparse_backward
from attention.block_sparse.cuda import flex_attention
from attention.block_sparse.forward import CHUNK_TOKENS, block_sparse_forward
from attention.block_sparse.params import (
    BlockSparseParams,
    _cached_block_mask,
    block_sparse_periods,
    check_block_sparse,
)
from attention.hilbert import in_order
from attention.plans import resolve_plan
from attention.registry import BenchParams, Exact, KernelSpec, register


def cuda_head_dim_problem(
    params: BlockSparseParams, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why block_sparse with `params` cannot run `head_dim` on CUDA: the cuda plan (auto's on
    CUDA) runs compiled FlexAttention, the cpu plan the primitive's fused ops."""
    if resolve_plan(params.plan, torch.device("cuda")) == "cuda":
        return cuda.head_dim_problem(head_dim)
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
        (attention.block_sparse.cuda.compiles)."""
        plan = resolve_plan(self.params.plan, device)
        return plan == "cuda" and cuda.compiles(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        check_block_sparse(self.params, seq_len=q.shape[1], num_heads=q.shape[2])
        plan = resolve_plan(self.params.plan, q.device)
        self.plan = plan
        if plan == "cuda":
            self.backend = f"{cuda.backend(q.device)}-plan-cuda"
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
        exact=Exact.BLOCKS,
        device_plan=True,
        bench_params=BenchParams(
            # FlexAttention's and most papers' 64 and 128 up to 1024; the CPU flash op tiles 256
            # query rows from 768 queries, 32 below 192
            cpu=tuple(
                {"block_size": bs, "pattern": "local_window", "sparsity_ratio": 0.25}
                for bs in (64, 128, 256, 1024)
            ),
            gpu={"block_size": 128, "pattern": "local_window", "sparsity_ratio": 0.25},
        ),
    )
)
