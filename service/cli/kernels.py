"""`ringlab kernels [NAME]`: the kernel catalogue the service serves at /api/v1/kernels, in the
terminal: each kernel's params with their defaults, the masks and balances it takes, and for
one kernel what its params mean."""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any

import typer

from service.cli.console import CliError, client, friendly_errors, out


def _default(prop: dict[str, Any]) -> str:
    """A param's default as YAML would read it ('null', 512, [1, 2]), or 'required'."""
    return json.dumps(prop["default"]) if "default" in prop else "required"


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
    lines.append(f"  masks: {', '.join(kernel['masks'])}")
    if kernel["balances"]:
        lines.append(f"  balances: {', '.join(kernel['balances'])}")
    props = (kernel["params_schema"] or {}).get("properties", {})
    params = ", ".join(f"{name} = {_default(p)}" for name, p in props.items()) or "none"
    lines.append(f"  params: {params}")
    return lines


def param_notes(kernel: dict[str, Any]) -> list[str]:
    """What the params mean, as the kernel's params class says (its docstring: allowed values
    and what null stands for), indented under the kernel; none when it says nothing."""
    about = ((kernel.get("params_schema") or {}).get("description") or "").split()
    if not about:
        return []
    lines, line = [], "  about the params:"
    for word in about:
        if len(line) + 1 + len(word) > 78:
            lines.append(line)
            line = "   "
        line += " " + word
    return [*lines, line]


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
        notes = param_notes(kernel) if name is not None else []
        for line in [*kernel_lines(kernel), *notes]:
            out.print(line, markup=False, highlight=False, soft_wrap=False)
