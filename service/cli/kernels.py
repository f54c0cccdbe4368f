"""`ringlab kernels [NAME]`: the kernel catalogue the service serves at /api/v1/kernels, in the
terminal: each kernel's params with their defaults, and the masks it takes."""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any

import typer

from service.cli.console import CliError, client, friendly_errors, out


def _default(prop: dict[str, Any]) -> str:
    """A param's default as YAML would read it ('null', 512, [1, 2]), or 'required'."""
    return json.dumps(prop["default"]) if "default" in prop else "required"


def masks(kernel: dict[str, Any]) -> list[str]:
    """The masks a kernel takes beside its own pattern: causal (every kernel: `causal: true`)
    and documents when its params have document_lengths."""
    props = (kernel["params_schema"] or {}).get("properties", {})
    return ["causal", *(["documents (document_lengths)"] if "document_lengths" in props else [])]


def kernel_lines(kernel: dict[str, Any]) -> list[str]:
    """One kernel (as /api/v1/kernels lists it): its name and kind, its description, its masks
    and each param = default; an unavailable one, why."""
    name, description = kernel["name"], kernel["description"]
    if not kernel.get("available", True):
        return [f"{name}  (unavailable)", f"  {description}: {kernel.get('error')}"]
    kind = "sequence-parallel" if kernel["distributed"] else "single-process"
    package = kernel.get("package")
    plugin = f", plugin {package} {kernel.get('version')}" if package else ""
    lines = [f"{name}  ({kind}{plugin})", f"  {description}"]
    lines.append(f"  masks: {', '.join(masks(kernel))}")
    props = (kernel["params_schema"] or {}).get("properties", {})
    params = ", ".join(f"{name} = {_default(p)}" for name, p in props.items()) or "none"
    lines.append(f"  params: {params}")
    return lines


@friendly_errors
def kernels(
    name: Annotated[str | None, typer.Argument(help="One kernel (default: every one).")] = None,
) -> None:
    """List the kernels a run may name (the service's /api/v1/kernels): params with their
    defaults, the masks each takes, and why an unavailable one did not load."""
    with client() as c:
        found = c.request("GET", "/kernels").json()
    if name is not None:
        names = [k["name"] for k in found]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; one of {', '.join(names)}"
            raise CliError(f"no kernel {name!r}{hint}")
        found = [k for k in found if k["name"] == name]
    for i, kernel in enumerate(found):
        if i:
            out.print()
        for line in kernel_lines(kernel):
            out.print(line, markup=False, highlight=False, soft_wrap=False)
