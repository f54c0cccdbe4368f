"""The settings a run resolves when its kernel is built, written into its config beforehand, so
that a stored config holds the values that ran, not the nulls and "auto" that stand for them.

Resolved here, from the config alone (no device needed):

- `layout` of a sharded kernel: None is zigzag when causal, contiguous otherwise
  (attention.ring.sharded.default_layout); ring_dilated's None is contiguous either way;
- `plan` "auto" of the kernels that choose a plan by the inputs' device (dilated, block_sparse,
  ring_dilated, and ulysses' inner kernel): the run's device when it names one (cpu or cuda);
  with device auto it stays "auto" (the device decides on the rank);
- ulysses' inner kernel params: each None field the inner kernel takes becomes its default.

A value given explicitly is never changed: resolution only replaces what would have been
resolved to the same value at build time, so the run computes exactly what it did before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attention
from attention.ring.sharded import default_layout
from workers.config import RunConfig

LAYOUT_DEFAULTS = {
    "ring": default_layout,
    "ring_block_sparse": default_layout,
    "allgather_kv": default_layout,
    "usp": default_layout,
    "ring_dilated": lambda layout, causal: layout or "contiguous",
}
"""The sharded kernels and how each resolves a None layout (its own module's rule)."""
PLAN_KERNELS = ("dilated", "block_sparse", "ring_dilated")
"""Kernels whose plan "auto" is chosen by the inputs' device (attention.dilated.resolve_plan,
attention.block_sparse.resolve_plan); the flex adapters and ring_block_sparse take none."""


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


def resolved_params(
    kernel: str, params: dict[str, Any], *, causal: bool, device: str
) -> dict[str, Any]:
    """`params` (normalized: every field present) with the build-time defaults resolved (see
    the module docstring); the same dict when nothing changes."""
    updates: dict[str, Any] = {}
    if kernel in LAYOUT_DEFAULTS and params.get("layout") is None:
        updates["layout"] = LAYOUT_DEFAULTS[kernel](None, causal)
    planned = kernel in PLAN_KERNELS
    if kernel == "ulysses":
        defaults = _inner_defaults(params["inner"])
        updates |= {n: d for n, d in defaults.items() if params.get(n) is None and d is not None}
        planned = params["inner"] in PLAN_KERNELS
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
    """The inverse of `resolved_params` for matching: `params` without the values resolution
    would have filled in (and without None), so a cell stored before resolution (layout null,
    plan auto) and one stored after (zigzag, cpu) are the same cell."""
    given = {k: v for k, v in params.items() if v is not None}
    if kernel in LAYOUT_DEFAULTS and given.get("layout") == LAYOUT_DEFAULTS[kernel](None, causal):
        given.pop("layout")
    inner = given.get("inner") if kernel == "ulysses" else None
    if inner in attention.KERNELS:
        defaults = _inner_defaults(inner)
        given = {k: v for k, v in given.items() if k not in defaults or v != defaults[k]}
    if (kernel in PLAN_KERNELS or inner in PLAN_KERNELS) and given.get("plan") in ("auto", device):
        given.pop("plan")
    return given
