"""Table columns generated from the engine's declaration of a result (workers.results).

A rank's measurement is declared once, as a field of a pydantic model in workers/results.py;
its table's columns follow from the model's stored fields (workers.results.stored_fields):
the name, the SQL type from the field's type, NULL allowed when the field admits None, and the
field's scalar default as the column's. A field whose SQL type is not the default for its
Python type (a 32-bit integer, a bounded string, an enum) names it in `types`.
"""

from __future__ import annotations

import types
from collections.abc import Collection, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from sqlalchemy import JSON, BigInteger, Boolean, Column, Float, Text
from sqlalchemy.types import TypeEngine

from workers.results import stored_fields

DEFAULT_TYPES: tuple[tuple[type, type[TypeEngine[Any]]], ...] = (
    (bool, Boolean),  # before int: bool is an int
    (int, BigInteger),
    (float, Float),
    (str, Text),
    (list, JSON),
    (dict, JSON),
)
"""The SQL type of a field's Python type, unless `types` names another."""


def columns_of(
    model: type[BaseModel],
    sql_types: Mapping[str, TypeEngine[Any]] | None = None,
    nullable: Collection[str] = (),
) -> list[Column[Any]]:
    """One column per stored field of `model`, in declaration order.

    sql_types: the SQL type of a field where the default (DEFAULT_TYPES) is not it. nullable:
    fields the engine always sets but rows stored before they existed hold as NULL.
    """
    sql_types = sql_types or {}
    unknown = (set(sql_types) | set(nullable)) - set(stored_fields(model))
    if unknown:
        raise ValueError(f"{model.__name__} stores no field {sorted(unknown)}")
    return [
        _column(name, model.model_fields[name], sql_types.get(name), name in nullable)
        for name in stored_fields(model)
    ]


def _column(
    name: str, info: FieldInfo, sql_type: TypeEngine[Any] | None, old_rows_null: bool
) -> Column[Any]:
    python_type, optional = _unwrap(info.annotation)
    default = info.default
    scalar = isinstance(default, bool | int | float | str)
    return Column(
        name,
        sql_type if sql_type is not None else _sql_type(name, python_type),
        nullable=optional or old_rows_null,
        default=default if scalar and default is not PydanticUndefined else None,
        doc=info.description,
    )


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X` or `X | None`."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return annotation, False
    args = get_args(annotation)
    rest = [a for a in args if a is not type(None)]
    if len(rest) != 1:
        raise TypeError(f"no column type for the union {annotation}")
    return rest[0], len(rest) < len(args)


def _sql_type(name: str, python_type: Any) -> TypeEngine[Any]:
    origin = get_origin(python_type) or python_type
    if origin is not Literal:
        for kind, sql in DEFAULT_TYPES:
            if isinstance(origin, type) and issubclass(origin, kind):
                return sql()
    raise TypeError(f"field {name}: no default column type for {python_type}; name one")
