"""The field tables of docs/sweeps.md, generated from the pydantic schema (RunConfig,
SearchConfig, SweepSpec) so the reference cannot drift from what the service accepts.

    python -m service.spec_docs           # rewrite the tables in docs/sweeps.md
    python -m service.spec_docs --check   # exit 1 when docs/sweeps.md is out of date (tests)
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from service.spec import SweepSpec
from workers.config import RunConfig, SearchConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "sweeps.md"
TABLES: dict[str, type[BaseModel]] = {
    "sweep-fields": SweepSpec,
    "run-fields": RunConfig,
    "search-fields": SearchConfig,
}
"""The marker name of each generated table in the document, and the model it lists."""

UNITS = {"seq_len": "tokens", "start": "tokens", "max": "tokens", "granularity": "tokens",
         "batch_size": "sequences", "head_dim": "channels", "world_size": "ranks",
         "warmup": "iterations", "iterations": "iterations", "max_attempts": "tries"}  # fmt: skip
"""The unit of a field whose name does not say it (a name ending in _s is seconds, in _bytes
bytes)."""


def _unit(name: str) -> str:
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "s"
    return UNITS.get(name, "")


def _type(annotation: Any) -> str:
    """A type as a reader writes it: `int`, `"forward" | "train"`, `SearchConfig | null`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f'"{v}"' for v in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int) and value >= 1 << 20:
        return f"{value:,}"
    return str(value)


def field_table(model: type[BaseModel]) -> str:
    """One markdown row per field: name, type, default, unit, meaning (its description)."""
    lines = ["| field | type | default | unit | meaning |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        meaning = " ".join((info.description or "").split()).replace("|", "\\|")
        row = [f"`{name}`", _type(info.annotation), _default(info), _unit(name), meaning]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render(text: str) -> str:
    """The document with every generated table between its markers replaced."""
    for marker, model in TABLES.items():
        begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{field_table(model)}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    fresh = render(current)
    if "--check" in argv:
        if fresh != current:
            print(f"{DOC} is out of date: python -m service.spec_docs", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
