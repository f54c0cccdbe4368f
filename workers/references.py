"""The exact reference each kernel is checked against by the correctness gate.

Plain einsum softmax attention for dense (under the exact predicate of the params' `mask`,
attention.mask.parse(mask).keep, when they hold one); for sparse kernels the same, restricted to the
kernel's explicit token masks (attention.masks, as in the attention tests); a ring kernel is
checked against the reference of its single-process twin. Which of these a built-in kernel
gets is its KernelSpec's `exact` (attention.registry.Exact), mapped once here (EXACT).

Every reference takes the query rows it computes: `reference(q, k, v, causal, rows)` with q
holding the query rows at the positions `rows` (a 1-D int64 tensor; None: every row) and k, v
the whole sequence. It builds only those rows of its mask, so the gate (workers.gate) checks a
few hundred rows at a run's full length in O(rows x seq_len) memory.

A layer kernel (multihead) is checked with a REFERENCE_DTYPE copy of the built layer's weights
(`layer_reference`): torch.nn.MultiheadAttention around dense attention, explicit projections
around the inner kernel's reference otherwise. Kernels without a reference are refused.

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
from attention import Exact
from attention.hilbert import hilbert_permutation, inverse_permutation
from attention.mask import parse as parse_mask
from attention.mask.takes import check_causal
from attention.masks import (
    block_token_rows,
    causal_rows,
    dilated_reference,
    document_rows,
    masked_attention,
)
from attention.multihead import MultiheadAttention
from workers import kernels

Reference = Callable[..., torch.Tensor]
"""(q, k, v, causal, rows=None) -> the output at the query rows `rows` (see the docstring)."""
REFERENCE_DTYPE = torch.float64
GATE_MASK_TOKENS = 8192
"""Up to this length a plugin without keep_rows has its rows taken from its whole keep_mask
(64 MiB of bools); beyond it the plugin must declare keep_rows."""


@dataclasses.dataclass(frozen=True)
class _Call:
    """One reference call: q holds the query rows at positions `rows` (resolved: on q's device),
    k and v the whole sequence."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    rows: torch.Tensor


def _reference(body: Callable[[_Call], torch.Tensor]) -> Reference:
    """The Reference that runs `body` on its call, `rows` resolved (None: every row q holds):
    the one place the references' calling convention is spelled out."""

    def reference(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        resolved = torch.arange(q.shape[1], device=q.device) if rows is None else rows.to(q.device)
        return body(_Call(q, k, v, causal, resolved))

    return reference


def _ordered(params: Any, inner: Reference) -> Reference:
    """Apply the kernel's token ordering (hilbert) around a reference on natural positions."""
    if getattr(params, "ordering", "natural") != "hilbert":
        return inner

    def permuted(c: _Call) -> torch.Tensor:
        # natural row i is row inverse[i] of the permuted sequence, whose query is q[i]
        perm = hilbert_permutation(c.k.shape[1], c.k.device)
        inverse = inverse_permutation(perm)
        return inner(c.q, c.k[:, perm], c.v[:, perm], c.causal, inverse[c.rows])

    return _reference(permuted)


KeepOf = Callable[[int, bool, torch.Tensor], torch.Tensor]
"""(seq_len, causal, rows) -> bool (len(rows), seq_len): which keys each of those query rows
keeps (rows on the inputs' device)."""


def _masked(keep_of: KeepOf) -> Reference:
    """Plain einsum softmax attention (not SDPA: the kernel under test must not check itself)
    under the keys `keep_of` keeps for each query row computed."""

    def masked(c: _Call) -> torch.Tensor:
        return masked_attention(c.q, c.k, c.v, keep_of(c.k.shape[1], c.causal, c.rows))[0]

    return _reference(masked)


def _every_key(seq_len: int, causal: bool, rows: torch.Tensor) -> torch.Tensor:
    """Dense attention's keys: all of them, or those at or before the row when causal."""
    keep = torch.ones(len(rows), seq_len, dtype=torch.bool, device=rows.device)
    return causal_rows(keep, rows) if causal else keep


_dense = _masked(_every_key)


def _documents(lengths: tuple[int, ...]) -> Reference:
    """Packed documents: attention under the block-diagonal document mask."""
    return _masked(lambda seq_len, causal, rows: document_rows(lengths, rows, causal))


def _mask(spec: dict[str, Any]) -> Reference:
    """Attention under a run's mask (attention.mask.parse): its exact token predicate `keep`
    on the rows computed. The call's `causal` must be the mask's (as the kernel requires): a
    contradiction is an error here too, never a reference of the other mask."""

    def keep_of(seq_len: int, causal: bool, rows: torch.Tensor) -> torch.Tensor:
        check_causal(spec, causal)
        return parse_mask(spec, seq_len).rows(rows, seq_len)

    return _masked(keep_of)


def _dense_of(kernel: str, params: Any) -> Reference:
    """Exact dense attention: under the params' `mask` when they hold one, under the document
    mask when they pack documents (the older spelling), else full or causal as called."""
    mask = getattr(params, "mask", None)
    if mask is not None:
        return _mask(mask)
    lengths = getattr(params, "document_lengths", None)
    return _dense if lengths is None else _documents(lengths)


def _dilated(kernel: str, params: Any) -> Reference:
    def dilated(c: _Call) -> torch.Tensor:
        ws, rs = params.segment_lengths, params.dilation_rates
        return dilated_reference(c.q, c.k, c.v, ws, rs, causal=c.causal, rows=c.rows.cpu())

    return _ordered(params, _reference(dilated))


def _blocks(kernel: str, params: Any) -> Reference:
    """Attention on the tokens of the built module's block mask (in its token ordering)."""
    module = attention.build(kernel, **_as_dict(params))

    def keep_of(seq_len: int, causal: bool, rows: torch.Tensor) -> torch.Tensor:
        return block_token_rows(
            module.block_mask(seq_len), params.block_size, rows, seq_len, causal
        )

    return _ordered(params, _masked(keep_of))


EXACT: dict[Exact, Callable[[str, Any], Reference]] = {
    Exact.DENSE: _dense_of,
    Exact.DILATED: _dilated,
    Exact.BLOCKS: _blocks,
}
"""Each kind of exact output (KernelSpec.exact) -> (kernel, parsed params) -> its reference."""


def _exact(kernel: str) -> Exact | None:
    """The kernel's declared kind of exact output (None: unknown kernel or none declared)."""
    spec = attention.KERNELS.get(kernel)
    return None if spec is None else spec.exact


def _plugin(spec: attention.KernelSpec, params: Any) -> Reference:
    """A plugin kernel's reference: einsum softmax attention on its keep_rows, else on its
    keep_mask's rows (dense, with the causal mask when asked, when it declares neither)."""
    if spec.keep_mask is None and spec.keep_rows is None:
        return _dense
    return _masked(lambda seq_len, causal, rows: plugin_rows(spec, params, seq_len, causal, rows))


def plugin_rows(
    spec: attention.KernelSpec, params: Any, seq_len: int, causal: bool, rows: torch.Tensor
) -> torch.Tensor:
    """The rows `rows` of a plugin's mask: its keep_rows, or its keep_mask's rows up to
    GATE_MASK_TOKENS; a ValueError naming keep_rows beyond that (no silent shorter check)."""
    if spec.keep_rows is not None:
        keep = spec.keep_rows(params, seq_len, causal, rows)
    elif spec.keep_mask is not None and seq_len <= GATE_MASK_TOKENS:
        keep = spec.keep_mask(params, seq_len, causal, rows.device)[..., rows, :]
    else:
        raise ValueError(
            f"correctness_check: kernel {spec.name!r} declares keep_mask but no keep_rows, so "
            f"its rows at seq_len {seq_len} (over {GATE_MASK_TOKENS:,}) cannot be checked "
            "without the whole (seq_len, seq_len) mask; add keep_rows to its KernelSpec "
            "(docs/plugins.md)"
        )
    want = (len(rows), seq_len)
    if keep.dtype != torch.bool or tuple(keep.shape[-2:]) != want:
        raise ValueError(
            f"kernel {spec.name!r}: its mask rows must be bool (..., {want[0]}, {want[1]}), "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    return keep


def _as_dict(params: Any) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def describe(kernel: str, params: dict[str, Any]) -> str:
    """What `kernel(params)` is checked against, in words (for error messages)."""
    spec = attention.KERNELS.get(kernel)
    if spec is not None and spec.plugin is not None and spec.twin is None:
        if spec.keep_mask is None and spec.keep_rows is None:
            return "einsum softmax attention (the plugin declares no keep_mask)"
        return "einsum softmax attention on the plugin's keep_mask"
    if spec is not None and spec.reference_of is not None:
        inner, inner_params = spec.reference_of(params)
        return f"the reference of {inner!r}: {describe(inner, inner_params)}"
    twin = attention.twin_of(kernel)
    if twin is not None:
        return f"the reference of its single-process twin {twin!r}"
    if _exact(kernel) is Exact.DENSE:
        mask = params.get("mask")
        if mask is not None:
            return f"einsum softmax attention under the mask {parse_mask(mask).kind}"
        return "einsum softmax attention"
    if kernels.is_layer(kernel):
        inner = attention.make_params(kernel, params).kernel
        if _exact(inner) is Exact.DENSE:
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

    def layer(c: _Call) -> torch.Tensor:
        mask = None
        if c.causal:  # True: the key is masked out, i.e. every key after the query
            keys = torch.arange(c.k.shape[1], device=c.q.device)
            mask = keys[None, :] > c.rows[:, None]
        out, _ = mha(c.q, c.k, c.v, attn_mask=mask, need_weights=True)
        return out

    return _reference(layer)


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

    def projected(c: _Call) -> torch.Tensor:
        e = c.q.shape[-1]
        split = [
            F.linear(x, w, bias).unflatten(-1, (-1, e // heads))  # k, v: num_kv_heads
            for x, w, bias in zip((c.q, c.k, c.v), weights[:3], biases[:3], strict=True)
        ]
        out = inner(*split, c.causal, c.rows).flatten(-2)
        return F.linear(out, weights[3], biases[3])

    return _reference(projected)


def layer_reference(layer: nn.Module) -> Reference:
    """The REFERENCE_DTYPE reference of a built layer kernel, on a copy of its weights taken now.

    A dense inner kernel without grouped-query heads: torch.nn.MultiheadAttention (which has
    none); any other: explicit projections around the inner kernel's own reference. The copy
    makes the reference independent of the module: a weight changed after this call shows as
    an error.
    """
    if not isinstance(layer, MultiheadAttention):
        raise TypeError(f"layer_reference: expected a multihead layer, got {type(layer).__name__}")
    inner = layer.params.kernel_params or {}
    plain = not inner.get("document_lengths") and inner.get("mask") is None
    dense = _exact(layer.params.kernel) is Exact.DENSE
    if dense and layer.num_kv_heads == layer.num_heads and plain:
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
    if spec is not None and spec.reference_of is not None:  # ulysses: its inner kernel's
        return reference_for(*spec.reference_of(params))
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
    exact = _exact(kernel)
    if exact is not None:
        return EXACT[exact](kernel, parsed)
    supported = ", ".join(sorted(k for k, s in attention.KERNELS.items() if s.exact is not None))
    raise ValueError(
        f"correctness_check: no exact reference for kernel {kernel!r} (supported: "
        f"{supported} and their ring variants)"
    )
