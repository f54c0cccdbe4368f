"""A kernel's params checked strictly (types included) and normalized with their defaults,
the same way for a sweep's cells and for a baseline that names another kernel."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

import attention
from attention.registry import unavailable
from service.spec_cells import canonical_json
from service.spec_fields import field_error, split_message


@lru_cache(maxsize=64)
def _params_adapter(params_type: type) -> TypeAdapter[Any]:
    return TypeAdapter(params_type)


def _kernels() -> dict[str, Any]:
    return attention.KERNELS


ParamsCheck = tuple[dict[str, Any] | None, list[tuple[tuple[str | int, ...], str]]]


def _unknown_kernel(kernel: Any, kernels: Iterable[str]) -> str:
    """'unknown kernel 'ring_dilatd'; did you mean 'ring_dilated'? valid: ...'."""
    names = sorted(kernels)
    close = difflib.get_close_matches(str(kernel), names, n=1) if isinstance(kernel, str) else []
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown kernel {kernel!r}; {hint}valid: {', '.join(names)}"


def normalize_params(kernel: Any, params: Any) -> ParamsCheck:
    """Check a kernel's params strictly (types included) and fill in their defaults.

    Returns (normalized params, []) or (None, [(field path, reason), ...]) where the path starts
    with 'kernel' or 'params'.
    """
    kernels = _kernels()
    if isinstance(kernel, str) and (why := unavailable(kernel)) is not None:
        return None, [(("kernel",), why)]
    if not isinstance(kernel, str) or kernel not in kernels:
        return None, [(("kernel",), _unknown_kernel(kernel, kernels))]
    if not isinstance(params, dict):
        return None, [(("params",), "must be an object of the kernel's parameters")]
    params_type = kernels[kernel].params
    names = [f.name for f in dataclasses.fields(params_type) if f.init]
    unknown = sorted(set(params) - set(names))
    if unknown:
        valid = ", ".join(sorted(names)) or "none"
        return None, [
            (("params", name), f"unknown parameter of kernel {kernel!r}; valid: {valid}")
            for name in unknown
        ]
    adapter = _params_adapter(params_type)
    try:
        # JSON mode, strict: "64" is not an int, but a JSON array is a valid tuple.
        parsed = adapter.validate_json(canonical_json(params), strict=True)
    except ValidationError as e:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for d in e.errors():
            msg = d["msg"].removeprefix("Value error, ")
            split = (field_error(d) or split_message(msg)) if not d["loc"] else None
            if split is not None and split[0][0] in names:  # the kernel's own field: mask
                problems.append((("params", *split[0]), split[1]))
            elif split is not None:
                problems.append(split)
            else:
                problems.append((("params", *d["loc"]), msg))
        return None, problems
    dumped = adapter.dump_python(parsed, mode="json")
    return {k: dumped[k] for k in names}, []
