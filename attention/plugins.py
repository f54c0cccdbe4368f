"""Kernels from installed packages: the entry-point group `ringlab.kernels` (docs/plugins.md).

Plugins load when `attention` is first imported: a program that imports a plugin's module
directly must import `attention` first (the plugin imports attention's API while attention
loads the plugin).

Each entry point names a callable returning a list of KernelSpec (one KernelSpec is accepted
too); `load()` registers them, marked with the providing package and its version. A plugin
that fails (its import raises, it returns something else, or a kernel name is taken) is
recorded in `registry.UNAVAILABLE` under the entry point's name with its error, which the
catalogue lists and a run config naming it gets as its `kernel` error. Nothing is skipped
silently.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import EntryPoint, entry_points

from attention.registry import KERNELS, UNAVAILABLE, KernelSpec, PluginInfo, Unavailable, register

GROUP = "ringlab.kernels"


def _info(ep: EntryPoint) -> PluginInfo:
    dist = ep.dist
    package = dist.metadata["Name"] if dist is not None else ep.module
    version = dist.version if dist is not None else "unknown"
    return PluginInfo(package=package, version=version, entry_point=f"{ep.name} = {ep.value}")


def _specs(ep: EntryPoint) -> list[KernelSpec]:
    """The entry point's kernel specs, checked; raises on anything a plugin got wrong."""
    made = ep.load()()
    specs = [made] if isinstance(made, KernelSpec) else list(made)
    for spec in specs:
        if not isinstance(spec, KernelSpec):
            raise TypeError(f"expected attention.KernelSpec objects, got {type(spec).__name__}")
        if spec.name in KERNELS:
            raise ValueError(f"kernel {spec.name!r} is already registered")
        for hook in ("keep_mask", "keep_rows", "periods"):
            if getattr(spec, hook) is not None and not callable(getattr(spec, hook)):
                raise TypeError(f"kernel {spec.name!r}: {hook} must be callable")
    if not specs:
        raise ValueError("the entry point returned no kernel specs")
    return specs


def load() -> None:
    """Register every installed plugin's kernels (once per process: attention's import)."""
    for ep in entry_points(group=GROUP):
        info = _info(ep)
        added: list[str] = []
        try:
            for spec in _specs(ep):
                register(dataclasses.replace(spec, plugin=info))
                added.append(spec.name)
        # A plugin's import can raise anything; it is recorded and shown, never swallowed.
        except Exception as exc:
            for name in added:  # all of a plugin's kernels, or none
                del KERNELS[name]
            UNAVAILABLE[ep.name] = Unavailable(ep.name, info, f"{type(exc).__name__}: {exc}")


def versions() -> dict[str, str]:
    """package -> version of every plugin package installed (loaded or not)."""
    found = {s.plugin.package: s.plugin.version for s in KERNELS.values() if s.plugin}
    found.update({u.plugin.package: u.plugin.version for u in UNAVAILABLE.values()})
    return dict(sorted(found.items()))
