"""The exact reference each kernel is checked against by the correctness gate.

Plain einsum softmax attention for dense; for sparse kernels the same, restricted to the
kernel's explicit token masks (attention.masks, as in the attention tests); a ring kernel is
checked against the reference of its single-process twin. A layer kernel (multihead) is checked
with a REFERENCE_DTYPE copy of the built layer's weights (`layer_reference`):
torch.nn.MultiheadAttention around dense attention, explicit projections around the inner
kernel's reference otherwise. Kernels without a reference are refused.

References run in REFERENCE_DTYPE (float64), so that the error the gate reports is the kernel's
own: a float32 reference adds its own rounding, which for the einsum softmax's gradients was
5x the kernel's (1.9e-5 against 3.6e-6 at 128 tokens) and on another CPU reached the float32
tolerance by itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import attention
from attention.multihead import MultiheadAttention
from workers import kernels

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
REFERENCE_DTYPE = torch.float64


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


def _documents(lengths: tuple[int, ...]) -> Reference:
    """Packed documents: einsum softmax attention under the block-diagonal document mask."""
    from attention.documents import document_mask
    from attention.masks import masked_attention

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return masked_attention(q, k, v, document_mask(lengths, causal, q.device))[0]

    return reference


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
        keep = block_token_mask(
            module.block_mask(q.shape[1]), params.block_size, causal=causal, seq_len=q.shape[1]
        )
        return masked_attention(q, k, v, keep)[0]

    return _ordered(params, reference)


def _plugin(spec: attention.KernelSpec, params: Any) -> Reference:
    """A plugin kernel's reference: einsum softmax attention on its keep_mask (dense, with the
    causal mask when asked, without one)."""
    keep_mask = spec.keep_mask
    if keep_mask is None:
        return _dense
    from attention.masks import masked_attention

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        keep = keep_mask(params, q.shape[1], causal, q.device)
        return masked_attention(q, k, v, keep)[0]

    return reference


def _as_dict(params: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def describe(kernel: str, params: dict[str, Any]) -> str:
    """What `kernel(params)` is checked against, in words (for error messages)."""
    spec = attention.KERNELS.get(kernel)
    if spec is not None and spec.plugin is not None and spec.twin is None:
        if spec.keep_mask is None:
            return "einsum softmax attention (the plugin declares no keep_mask)"
        return "einsum softmax attention on the plugin's keep_mask"
    twin = attention.twin_of(kernel)
    if twin is not None:
        return f"the reference of its single-process twin {twin!r}"
    if kernel == "dense":
        return "einsum softmax attention"
    if kernels.is_layer(kernel):
        inner = attention.make_params(kernel, params).kernel
        if inner == "dense":
            return "torch.nn.MultiheadAttention with the layer's weights"
        return f"the layer's projections around {describe(inner, {})}"
    return f"dense attention on the explicit masks of {kernel!r}"


def _mha_reference(layer: MultiheadAttention) -> Reference:
    """torch.nn.MultiheadAttention (batch_first, REFERENCE_DTYPE) holding the layer's weights.

    need_weights=True makes it compute softmax(QK^T)V with explicit matmuls, not SDPA (which
    the dense kernel under test runs); a causal call passes an explicit causal attn_mask.
    """
    device = layer.q_proj.weight.device
    mha = nn.MultiheadAttention(
        layer.embed_dim,
        layer.num_heads,
        bias=layer.params.bias,
        batch_first=True,
        device=device,
        dtype=REFERENCE_DTYPE,
    )
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
        mha.out_proj.weight.copy_(layer.out_proj.weight)
        if layer.params.bias:
            mha.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
            mha.out_proj.bias.copy_(layer.out_proj.bias)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        seq_len = q.shape[1]
        mask = None
        if causal:  # True: the key is masked out, i.e. every key after the query
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        out, _ = mha(q, k, v, attn_mask=mask, need_weights=True)
        return out

    return reference


def _projected_reference(layer: MultiheadAttention) -> Reference:
    """Explicit REFERENCE_DTYPE projections with a copy of the layer's weights around the
    reference of its inner kernel (for inner kernels other than dense)."""
    inner = reference_for(layer.params.kernel, layer.params.kernel_params)
    linears = (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj)
    weights = [lin.weight.detach().to(REFERENCE_DTYPE, copy=True) for lin in linears]
    biases = [
        None if lin.bias is None else lin.bias.detach().to(REFERENCE_DTYPE, copy=True)
        for lin in linears
    ]
    heads = layer.num_heads

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        b, s, e = q.shape
        split = [
            F.linear(x, w, bias).view(b, s, -1, e // heads)  # k, v: num_kv_heads
            for x, w, bias in zip((q, k, v), weights[:3], biases[:3], strict=True)
        ]
        out = inner(*split, causal).reshape(b, s, e)
        return F.linear(out, weights[3], biases[3])

    return reference


def layer_reference(layer: nn.Module) -> Reference:
    """The REFERENCE_DTYPE reference of a built layer kernel, on a copy of its weights taken now.

    A dense inner kernel without grouped-query heads: torch.nn.MultiheadAttention (which has
    none); any other: explicit projections around the inner kernel's own reference. The copy
    makes the reference independent of the module: a weight changed after this call shows as
    an error.
    """
    if not isinstance(layer, MultiheadAttention):
        raise TypeError(f"layer_reference: expected a multihead layer, got {type(layer).__name__}")
    plain = not (layer.params.kernel_params or {}).get("document_lengths")
    if layer.params.kernel == "dense" and layer.num_kv_heads == layer.num_heads and plain:
        return _mha_reference(layer)
    return _projected_reference(layer)


def check_available(kernel: str, params: dict[str, Any]) -> None:
    """Raise ValueError unless the correctness gate can check `kernel(params)` (for a layer
    kernel: unless its inner kernel has a reference)."""
    if kernels.is_layer(kernel):
        inner = attention.make_params(kernel, params)
        reference_for(inner.kernel, inner.kernel_params)
        return
    reference_for(kernel, params)


def reference_for(kernel: str, params: dict[str, Any]) -> Reference:
    """The exact reference of `kernel(params)`, run in REFERENCE_DTYPE; ValueError if none.

    A layer kernel's reference needs the built layer's weights: `layer_reference(module)`.
    A plugin kernel's is ours on its declared keep_mask (never the plugin's own code).
    """
    spec = attention.KERNELS.get(kernel)
    if spec is not None and spec.plugin is not None and spec.twin is None:
        return _plugin(spec, attention.make_params(kernel, params))
    twin = attention.twin_of(kernel)
    if twin is not None:  # its params as the twin takes them (an adapter adds its own, too)
        fields = {f.name for f in dataclasses.fields(attention.KERNELS[twin].params)}
        shared = {k: v for k, v in attention.twin_params(params).items() if k in fields}
        return reference_for(twin, shared)
    parsed = attention.make_params(kernel, params)
    if kernels.is_layer(kernel):
        raise ValueError(
            f"correctness_check: {kernel!r} is checked with the built layer's weights: "
            "use references.layer_reference(module)"
        )
    if kernel == "dense":
        return _dense if parsed.document_lengths is None else _documents(parsed.document_lengths)
    if kernel == "dilated":
        return _dilated(parsed)
    if kernel == "block_sparse":
        return _block_sparse(parsed)
    raise ValueError(
        f"correctness_check: no exact reference for kernel {kernel!r} (supported: dense, "
        f"dilated, block_sparse and their ring variants)"
    )
