"""The names a sweep spec uses for run config fields and axes, and the shape of its errors.

Every part of the spec (its models, the structural checks, the expansion) names fields the
same way and reports an error as pydantic does: a `loc` path and a message (SpecError).
"""

from __future__ import annotations

from typing import Any

from attention.errors import ParamError
from workers.config import RunConfig

MAX_ERRORS = 20
"""Expansion stops after this many distinct errors (the rest are usually the same mistake)."""
RUN_FIELDS = frozenset(RunConfig.model_fields) - {"search"}
SPEC_FIELDS = RUN_FIELDS | {"mask"}
"""What a spec may give a run: its config fields and a run-level `mask`, which expansion
stores as causal and params.mask (service.spec_mask)."""

Loc = tuple[str | int, ...]


NESTED = ("params", "model", "training")
"""Config fields that are objects: an axis or baseline change names one of their fields as
`<field>.<name>` (params.block_size, model.d_model, training.precision)."""


def nested_axis(name: str) -> tuple[str, str] | None:
    """'model.d_model' -> ('model', 'd_model'); None for a plain field name."""
    head, dot, rest = name.partition(".")
    if dot and head in NESTED and rest.isidentifier():
        return head, rest
    return None


def axis_name(name: str) -> str:
    """A run config field or <params|model|training>.<name>, else ValueError naming what is
    allowed."""
    if nested_axis(name) is not None:
        return name
    if name in RUN_FIELDS and name != "params":
        return name
    raise ValueError(
        f"{name!r} is not a run config field, params.<name>, model.<name> or training.<name>"
    )


def shown_key(key: Any) -> str:
    """A key as an error's loc shows it: NUL and lone surrogates escaped."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


class SpecError(ValueError):
    """A spec that cannot be expanded; `errors` are pydantic-style dicts (loc without 'body')."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))


def err(loc: Loc, msg: str, kind: str = "value_error") -> dict[str, Any]:
    return {"loc": list(loc), "msg": msg, "type": kind}


def field_error(detail: Any) -> tuple[tuple[str, ...], str] | None:
    """(field path, reason) of a validator's ParamError (attention's checks, RunConfig's
    validators), read from the exception pydantic keeps; None for other errors."""
    error = (detail.get("ctx") or {}).get("error")
    if isinstance(error, ParamError):
        return error.path, error.reason
    return None


def split_message(msg: str) -> tuple[tuple[str, ...], str] | None:
    """'params.block_size: reason' -> (('params', 'block_size'), 'reason'); None if no field.

    RunConfig's model validator and attention.validate start their messages with the field.
    """
    head, sep, reason = msg.partition(": ")
    if not sep:
        return None
    path = tuple(head.split("."))
    if path[0] not in RUN_FIELDS or not all(p.isidentifier() for p in path):
        return None
    return path, reason
