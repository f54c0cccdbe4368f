"""Sweep specs as `ringlab submit` and `ringlab demo` read them: a YAML file (one spec per
document) or a bundled example by name, a YAML mistake told as file:line:column with the line;
and a stored spec as `ringlab show` prints it. PyYAML loads only when a command reads or writes
a spec, off the CLI's start-up."""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.cli.console import CliError

if TYPE_CHECKING:
    from yaml import MarkedYAMLError


def bundled_examples() -> dict[str, Any]:
    """The example sweeps shipped in the package (service.examples = examples/*.yaml), by name."""
    folder = files("service.examples")
    found = (f for f in folder.iterdir() if f.name.endswith(".yaml") and f.is_file())
    return {f.name.removesuffix(".yaml"): f for f in sorted(found, key=lambda f: f.name)}


def _bundled(file: str) -> tuple[str, str]:
    """(label, text) of the bundled example `file` names: `cpu-quick` or `cpu-quick.yaml`."""
    examples = bundled_examples()
    path = Path(file)
    name = path.name.removesuffix(".yaml").removesuffix(".yml")
    # `examples/x.yaml` as the README writes it also works outside a checkout.
    if str(path.parent) in (".", "examples") and name in examples:
        return f"{name}.yaml (bundled)", examples[name].read_text()
    close = difflib.get_close_matches(name, examples, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise CliError(
        f"{file}: no such file, nor a bundled example of that name; {hint}"
        f"bundled examples: {', '.join(examples)}"
    )


def _not_yaml(label: str, e: Exception) -> CliError:
    """`file: not valid YAML: problem`, from a PyYAML error that marks no place."""
    return CliError(f"{label}: not valid YAML: {str(e).splitlines()[0]}")


def _yaml_error(label: str, text: str, e: MarkedYAMLError) -> CliError:
    """`file:line:column: problem` and the offending line, from a PyYAML error."""
    if e.problem_mark is None:
        return _not_yaml(label, e)
    mark, context = e.problem_mark, e.context_mark
    message = f"{label}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {e.problem}"
    if e.context and context is not None:
        message += f" ({e.context} at line {context.line + 1}, column {context.column + 1})"
    # The line to look at: where the unclosed bracket or quote opened, else where parsing stopped.
    lines = text.splitlines()
    at = context if context is not None and context.line < len(lines) else mark
    shown = lines[at.line] if at.line < len(lines) else ""
    return CliError(message, detail=f"  {at.line + 1} | {shown}" if shown.strip() else None)


def load_specs(file: str) -> list[dict[str, Any]]:
    """The sweep specs of a YAML file (one per document), or of a bundled example by name
    (`cpu-quick` or `cpu-quick.yaml`)."""
    import yaml  # PyYAML: ~25 ms, kept off start-up

    path = Path(file)
    if path.is_file():
        label, text = file, path.read_text()
    else:
        label, text = _bundled(file)
    try:
        specs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.MarkedYAMLError as e:
        raise _yaml_error(label, text, e) from None
    except yaml.YAMLError as e:
        raise _not_yaml(label, e) from None
    if not specs:
        raise CliError(f"{label}: no sweep spec in it")
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise CliError(f"{label}: documents[{i}] is not a mapping (name, kind, base, grid...)")
    return specs


def _set_only(value: Any) -> Any:
    """`value` without the mapping entries that are null: the stored spec fills every field a
    researcher left unset with null (each kernel's params whole), which is not what they wrote.
    Nulls inside lists are values of an axis (a layout's default beside zigzag) and stay."""
    if isinstance(value, dict):
        return {k: _set_only(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_set_only(v) for v in value]
    return value


def spec_yaml(spec: dict[str, Any]) -> str:
    """A stored spec as YAML, its keys in their stored order, unset (null) fields left out."""
    import yaml  # PyYAML: ~25 ms, kept off start-up

    return yaml.safe_dump(_set_only(spec), sort_keys=False).rstrip()
