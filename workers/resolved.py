"""The settings a run resolves when its kernel is built, written into its config beforehand, so
that a stored config holds the values that ran, not the nulls and "auto" that stand for them.

Resolved here, from the config alone (no device needed):

- `layout` of a sharded kernel: None becomes what its KernelSpec's `default_layout` makes of it
  (zigzag when causal, contiguous otherwise; ring_dilated's contiguous either way), unless its
  `balance` sets the shards' order (the kernel then refuses a layout);
- `plan` "auto" of the kernels that choose a plan by the inputs' device (KernelSpec
  `device_plan`: dilated, block_sparse, ring_dilated, and a wrapper's inner kernel): the run's
  device when it names one (cpu or cuda); with device auto it stays "auto" (the device decides
  on the rank);
- a wrapper's (KernelSpec `inner`: ulysses) inner kernel params: each None field the inner
  kernel takes becomes its default;
- a `mask` (params.mask, or a layer's params.kernel_params.mask) whose documents are `sampled`
  or read from a `lengths_file`: written out as its lengths at the run's seq_len
  (attention.mask.expand; a sampled spec stays beside them), so the stored config says what
  ran and the run can be reproduced. This one needs the seq_len, so it runs before the params
  are checked (`expanded_masks`), not in `resolve`.

A value given explicitly is never changed: resolution only replaces what would have been
resolved to the same value at build time, so the run computes exactly what it did before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attention
from attention.errors import ParamError
from attention.mask import expand
from attention.registry import KernelSpec
from workers.config import RunConfig


def _spec(kernel: str | None) -> KernelSpec | None:
    """The kernel's KernelSpec, None for a name not registered here (a stored row's plugin)."""
    return None if kernel is None else attention.KERNELS.get(kernel)


def _default_layout(kernel: str, causal: bool) -> str | None:
    """What a None layout of `kernel` resolves to (None: the kernel takes no layout)."""
    spec = _spec(kernel)
    if spec is None or spec.default_layout is None:
        return None
    return spec.default_layout(None, causal)


def _device_plan(kernel: str | None) -> bool:
    """Whether the kernel's plan "auto" is chosen by the inputs' device."""
    spec = _spec(kernel)
    return spec is not None and spec.device_plan


def _wraps(kernel: str) -> bool:
    """Whether the kernel runs an inner kernel named by its params' `inner` (ulysses)."""
    spec = _spec(kernel)
    return spec is not None and bool(spec.inner)


def _json(value: Any) -> Any:
    """A dataclass field's default as the stored config holds it (tuples as lists)."""
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value


def _inner_defaults(inner: str) -> dict[str, Any]:
    """The defaults of every init field of an inner kernel's params."""
    parsed = attention.make_params(inner, {})
    fields = dataclasses.fields(attention.KERNELS[inner].params)
    return {f.name: _json(getattr(parsed, f.name)) for f in fields if f.init}


def _declared_defaults(kernel: str) -> dict[str, Any]:
    """The defaults a kernel's params dataclass declares (ulysses' inner dense, dilated's
    ordering natural): a value equal to one was not asked for; {} for an unknown kernel."""
    spec = _spec(kernel)
    if spec is None:
        return {}
    out = {}
    for f in dataclasses.fields(spec.params):
        if f.init and f.default is not dataclasses.MISSING and f.default is not None:
            out[f.name] = _json(f.default)
    return out


EXPANDED_SOURCES = ("sampled", "lengths_file")
"""The fields of a documents mask that `expand` writes out as lengths."""


def needs_length(mask: Any) -> bool:
    """Whether a mask dict's documents are drawn or read at the run's seq_len (sampled or a
    lengths file, not yet written out as `lengths`)."""
    return (
        isinstance(mask, dict)
        and "lengths" not in mask
        and any(key in mask for key in EXPANDED_SOURCES)
    )


def holds_unexpanded_mask(value: Any) -> bool:
    """Whether `value` (params, a mask, or any JSON holding them) has a mask that
    `needs_length` anywhere inside: the cells of such a sweep differ in params by seq_len."""
    if isinstance(value, dict):
        if needs_length(value) or needs_length(value.get("mask")):
            return True
        return any(holds_unexpanded_mask(v) for v in value.values())
    if isinstance(value, list):
        return any(holds_unexpanded_mask(v) for v in value)
    return False


def fixes_length(params: Any) -> bool:
    """Whether params hold a documents mask (params.mask, or a layer's kernel_params.mask):
    its lengths sum to one seq_len, so no other length can run it."""
    if not isinstance(params, dict):
        return False
    inner = params.get("kernel_params")
    masks = [params.get("mask"), inner.get("mask") if isinstance(inner, dict) else None]
    return any(isinstance(m, dict) and m.get("kind") == "documents" for m in masks)


def expanded_masks(params: Any, seq_len: Any) -> Any:
    """`params` with each mask that `needs_length` (params.mask, and a layer's
    params.kernel_params.mask) written out at `seq_len` (attention.mask.expand); the same
    object when there is none, or when seq_len is not a positive int (the config's own check
    reports that). A bad mask raises ParamError at its path under params."""
    if not isinstance(params, dict) or isinstance(seq_len, bool) or not isinstance(seq_len, int):
        return params
    if seq_len < 1:
        return params
    updates: dict[str, Any] = {}
    if needs_length(params.get("mask")):
        updates["mask"] = _expand(params["mask"], seq_len, "params.mask")
    inner = params.get("kernel_params")
    if isinstance(inner, dict) and needs_length(inner.get("mask")):
        mask = _expand(inner["mask"], seq_len, "params.kernel_params.mask")
        updates["kernel_params"] = {**inner, "mask": mask}
    return {**params, **updates} if updates else params


def _expand(mask: dict[str, Any], seq_len: int, path: str) -> dict[str, Any]:
    """attention.mask.expand, its ParamError's path placed under `path`."""
    try:
        return expand(mask, seq_len)
    except ParamError as e:
        inside = ".".join(e.path[1:])  # expand names the mask "mask"
        raise ParamError(f"{path}.{inside}" if inside else path, e.reason) from e


def resolved_params(
    kernel: str, params: dict[str, Any], *, causal: bool, device: str
) -> dict[str, Any]:
    """`params` (normalized: every field present) with the build-time defaults resolved (see
    the module docstring); the same dict when nothing changes."""
    updates: dict[str, Any] = {}
    layout = _default_layout(kernel, causal)
    if layout is not None and params.get("layout") is None and params.get("balance") is None:
        updates["layout"] = layout  # a balance sets the order itself: its layout stays unset
    planned = _device_plan(kernel)
    if _wraps(kernel):
        defaults = _inner_defaults(params["inner"])
        updates |= {n: d for n, d in defaults.items() if params.get(n) is None and d is not None}
        planned = _device_plan(params["inner"])
    if planned and {**params, **updates}.get("plan") == "auto" and device in ("cpu", "cuda"):
        updates["plan"] = device
    return {**params, **updates} if updates else params


def resolve(config: RunConfig) -> RunConfig:
    """The config with its kernel's build-time defaults resolved into its params."""
    params = resolved_params(
        config.kernel, config.params, causal=config.causal, device=config.device
    )
    return config if params is config.params else config.model_copy(update={"params": params})


def as_given(kernel: str, params: dict[str, Any], *, causal: bool, device: str) -> dict[str, Any]:
    """The inverse of `resolved_params` for matching and labels: `params` without the values
    resolution would have filled in, without None and without a value equal to the default its
    kernel declares, a sampled mask without its written-out lengths (`mask_as_given`), so a
    cell stored before resolution (layout null, plan auto) and one stored after (zigzag, cpu)
    are the same cell, and ulysses' `inner: dense` is as if unset."""
    own = _declared_defaults(kernel)
    given = {k: v for k, v in params.items() if v is not None and (k not in own or v != own[k])}
    layout = _default_layout(kernel, causal)
    if layout is not None and given.get("layout") == layout:
        given.pop("layout")
    inner = given.get("inner") if _wraps(kernel) else None
    if inner in attention.KERNELS:
        defaults = _inner_defaults(inner)
        given = {k: v for k, v in given.items() if k not in defaults or v != defaults[k]}
    planned = _device_plan(kernel) or _device_plan(inner)
    if planned and given.get("plan") in ("auto", device):
        given.pop("plan")
    if isinstance(given.get("mask"), dict):
        given["mask"] = mask_as_given(given["mask"])
    return given


def mask_as_given(mask: dict[str, Any]) -> dict[str, Any]:
    """A stored mask as it was asked for: sampled lengths without the `lengths` expansion wrote
    out beside them (they follow from `sampled` and the seq_len)."""
    if "sampled" in mask and "lengths" in mask:
        return {k: v for k, v in mask.items() if k != "lengths"}
    return mask
