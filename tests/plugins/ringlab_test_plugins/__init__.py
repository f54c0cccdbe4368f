"""Deliberately wrong (unscaled, offset) and broken (import fails) ringlab kernel plugins, and
what the dense ones share."""

from __future__ import annotations

from dataclasses import dataclass

from attention import KernelSpec


@dataclass(frozen=True)
class NoParams:
    """No parameters."""


def one_kernel(
    name: str, description: str, factory: type, params: type = NoParams
) -> list[KernelSpec]:
    """An entry point's answer for one kernel `name` (exact dense attention: no keep_mask) built
    by `factory` from `params`."""
    return [KernelSpec(name=name, description=description, params=params, factory=factory)]
