"""`dense`: exact softmax attention through PyTorch's SDPA: the reference and the baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from attention import documents, primitive
from attention.base import (
    Kernel,
    KernelMemory,
    attention_flops,
    check_qkv,
    qkv_bytes,
)
from attention.mask import parse as parse_mask
from attention.mask.takes import (
    ALL_MASKS,
    check_causal,
    check_fits,
    check_no_lengths,
    kernel_mask,
)
from attention.registry import BenchParams, Exact, KernelSpec, register
from attention.ring.engine import ring_attention
from attention.ring.mask_plan import mask_plan


@dataclass(frozen=True)
class DenseParams:
    """document_lengths: documents packed into the sequence (attention.documents); None: the
    sequence is one document. mask: a run's mask (attention.mask.parse), any kind; None: full,
    or causal when called so (the older spelling, with document_lengths)."""

    document_lengths: tuple[int, ...] | None = None
    mask: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "document_lengths", documents.normalize(self.document_lengths))
        object.__setattr__(self, "mask", kernel_mask(self.mask, "dense", ALL_MASKS))
        check_no_lengths(self.mask, self.document_lengths)


def check_dense(
    params: DenseParams,
    *,
    seq_len: int,
    world_size: int = 1,
    num_heads: int = 1,
    causal: bool | None = None,
) -> None:
    """Packed documents must fill the sequence; a mask must fit it."""
    documents.check_total(params.document_lengths, seq_len)
    check_fits(params.mask, seq_len)


class DenseAttention(Kernel):
    """softmax(q k^T / sqrt(d)) v over the whole sequence, causal optional; k and v may have
    fewer heads (grouped-query attention: SDPA's enable_gqa). `backend` names the SDPA backend
    that ran its last call (sdpa-flash-cpu, sdpa-cudnn-cuda, ...: torch's own choice)."""

    def __init__(self, params: DenseParams | None = None) -> None:
        super().__init__(params or DenseParams())

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        check_qkv(q, k, v)
        if self.params.mask is not None:
            return self._masked(q, k, v, causal)
        lengths = self.params.document_lengths
        if lengths is None:
            out, ran = _sdpa(q, k, v, causal)
            self.backend = _backend_name([ran], q.device)
            return out
        documents.check_total(lengths, q.shape[1])
        pieces = [
            _sdpa(q[:, a:b], k[:, a:b], v[:, a:b], causal) for a, b in documents.bounds(lengths)
        ]
        self.backend = _backend_name([ran for _, ran in pieces], q.device)
        return torch.cat([out for out, _ in pieces], dim=1)

    def _masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        """Under params.mask: only the tiles that keep a pair, partial tiles under the mask's
        exact predicate (attention.ring.mask_plan), through the primitive on one rank."""
        seq_len = q.shape[1]
        check_causal(self.params.mask, causal)
        mask = parse_mask(self.params.mask, seq_len)
        self.backend = primitive.backend_for(q.device, q.dtype)
        plan = self.memo(("plan", seq_len), lambda: mask_plan(mask, torch.arange(seq_len), 0, 1))
        q, k, v = (t.contiguous() for t in (q, k, v))
        return ring_attention(q, k, v, plan, None, q.shape[-1] ** -0.5)

    def flops(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        backward: bool = False,
    ) -> int:
        if self.params.mask is not None:
            pairs = parse_mask(self.params.mask).pairs(seq_len)
        else:
            pairs = documents.pairs(self.params.document_lengths or (seq_len,), causal)
        return attention_flops(batch * num_heads * pairs, head_dim, backward=backward)

    def memory_model(
        self, batch: int, seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int
    ) -> KernelMemory:
        """SDPA (fused) saves q, k, v, its output and the fp32 log-sum-exp; the output it
        returns is the saved one. Backward allocates dq, dk, dv in the input dtype."""
        one = qkv_bytes(batch, seq_len, num_heads, head_dim, dtype_bytes)
        lse = 4 * batch * num_heads * seq_len
        return KernelMemory(
            saved=4 * one + lse, output_saved=True, forward_transient=0, backward_transient=3 * one
        )


SDPA_BACKEND_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
    SDPBackend.OVERRIDEABLE: "overrideable",
}
"""SDPA's backends by the names the `sdpa` kernel's params.backend uses."""


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, SDPBackend]:
    """SDPA on (b, s, h, d) tensors ((b, h, s, d) inside, and back), and the backend that ran:
    torch's own choice for these inputs and flags (aten::_fused_sdp_choice, the function SDPA
    dispatches by, under the same sdpa_kernel context), since SDPA may pick cuDNN before flash
    on Hopper with CUDA 13 and flash or math on the CPU."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = k.shape[2] != q.shape[2]
    chosen = SDPBackend(torch._fused_sdp_choice(qt, kt, vt, None, 0.0, causal, enable_gqa=gqa))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    if chosen == SDPBackend.ERROR:  # SDPA ran although its choice function found no backend
        raise RuntimeError(
            "dense: SDPA ran but torch._fused_sdp_choice names no backend for this call; "
            "the backend that ran is unknown"
        )
    return out.transpose(1, 2), chosen


def _backend_name(ran: list[SDPBackend], device: torch.device) -> str:
    """sdpa-<backend>-<device> (the `sdpa` kernel's form); several documents whose calls ran
    on different backends name each, joined by '+'."""
    names = sorted({SDPA_BACKEND_NAMES[b] for b in ran})
    return f"sdpa-{'+'.join(names)}-{device.type}"


register(
    KernelSpec(
        name="dense",
        description="Exact softmax attention (PyTorch SDPA): the reference and the baseline; "
        "document_lengths packs several documents into the sequence.",
        params=DenseParams,
        factory=DenseAttention,
        check=check_dense,
        exact=Exact.DENSE,
        dense_baseline=True,
        bench_params=BenchParams(cpu=({},), gpu={}),
        masks=ALL_MASKS,
    )
)
