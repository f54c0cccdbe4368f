"""The exact reference each kernel is checked against by the correctness gate.

Plain einsum softmax attention for dense; for sparse kernels the same, restricted to the
kernel's explicit token masks (attention.masks, as in the attention tests); a ring kernel is
checked against the reference of its single-process twin. Kernels without one are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import attention
from workers import kernels

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _ordered(params: Any, inner: Reference) -> Reference:
    """Apply the kernel's token ordering (hilbert) around a reference on natural positions."""
    if getattr(params, "ordering", "natural") != "hilbert":
        return inner
    from attention.hilbert import hilbert_permutation, inverse_permutation

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        perm = hilbert_permutation(q.shape[1], q.device)
        out = inner(q[:, perm], k[:, perm], v[:, perm], causal)
        return out[:, inverse_permutation(perm)]

    return reference


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Plain einsum softmax attention (not SDPA: the kernel under test must not check itself)."""
    from attention.masks import causal_mask, masked_attention

    seq_len = q.shape[1]
    keep = causal_mask(seq_len, q.device) if causal else torch.ones(seq_len, seq_len, dtype=bool)
    return masked_attention(q, k, v, keep)[0]


def _dilated(params: Any) -> Reference:
    from attention.masks import dilated_reference

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        ws, rs = params.segment_lengths, params.dilation_rates
        return dilated_reference(q, k, v, ws, rs, causal=causal)

    return _ordered(params, reference)


def _block_sparse(params: Any) -> Reference:
    from attention.masks import block_token_mask, masked_attention

    module = attention.build("block_sparse", **_as_dict(params))

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        keep = block_token_mask(module.block_mask(q.shape[1]), params.block_size, causal=causal)
        return masked_attention(q, k, v, keep)[0]

    return _ordered(params, reference)


def _as_dict(params: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def describe(kernel: str) -> str:
    """What `kernel` is checked against, in words (for error messages)."""
    if kernel in kernels.RING_TWINS:
        return f"the reference of its single-process twin {kernels.RING_TWINS[kernel]!r}"
    if kernel == "dense":
        return "einsum softmax attention"
    return f"dense attention on the explicit masks of {kernel!r}"


def reference_for(kernel: str, params: dict[str, Any]) -> Reference:
    """The exact float32-capable reference of `kernel(params)`; ValueError if there is none."""
    if kernel in kernels.RING_TWINS:
        twin = kernels.RING_TWINS[kernel]
        return reference_for(twin, kernels.params_for(twin, params))
    parsed = attention.make_params(kernel, params)
    if kernel == "dense":
        return _dense
    if kernel == "dilated":
        return _dilated(parsed)
    if kernel == "block_sparse":
        return _block_sparse(parsed)
    raise ValueError(
        f"correctness_check: no exact reference for kernel {kernel!r} (supported: dense, "
        f"dilated, block_sparse and their ring variants)"
    )
