"""`ringlab kernels [NAME]`: the kernel catalogue of /api/v1/kernels (the same
service.api.routes.kernels.catalogue) in the terminal: each kernel's params with their defaults,
and the masks it takes. Registered on service.cli's app when service.cli loads."""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any

import typer

from service.cli_base import CliError, app, friendly_errors, out


def _default(prop: dict[str, Any]) -> str:
    """A param's default as YAML would read it ('null', 512, [1, 2]), or 'required'."""
    return json.dumps(prop["default"]) if "default" in prop else "required"


def masks(kernel: Any) -> list[str]:
    """The masks a kernel takes beside its own pattern: causal (every kernel: `causal: true`)
    and documents when its params have document_lengths."""
    props = (kernel.params_schema or {}).get("properties", {})
    return ["causal", *(["documents (document_lengths)"] if "document_lengths" in props else [])]


def kernel_lines(kernel: Any) -> list[str]:
    """One kernel: its name and kind, its description, its masks and each param = default."""
    if not kernel.available:
        return [f"{kernel.name}  (unavailable)", f"  {kernel.description}: {kernel.error}"]
    kind = "sequence-parallel" if kernel.distributed else "single-process"
    plugin = f", plugin {kernel.package} {kernel.version}" if kernel.package else ""
    lines = [f"{kernel.name}  ({kind}{plugin})", f"  {kernel.description}"]
    lines.append(f"  masks: {', '.join(masks(kernel))}")
    props = (kernel.params_schema or {}).get("properties", {})
    params = ", ".join(f"{name} = {_default(p)}" for name, p in props.items()) or "none"
    lines.append(f"  params: {params}")
    return lines


@app.command()
@friendly_errors
def kernels(
    name: Annotated[str | None, typer.Argument(help="One kernel (default: every one).")] = None,
) -> None:
    """List the kernels a run may name (as /api/v1/kernels does): params with their defaults,
    the masks each takes, and why an unavailable one did not load."""
    from service.api.routes.kernels import catalogue

    found = catalogue()
    if name is not None:
        names = [k.name for k in found]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; one of {', '.join(names)}"
            raise CliError(f"no kernel {name!r}{hint}")
        found = [k for k in found if k.name == name]
    for i, kernel in enumerate(found):
        if i:
            out.print()
        for line in kernel_lines(kernel):
            out.print(line, markup=False, highlight=False, soft_wrap=False)
