"""Keyset (cursor) pages and capped counts: list endpoints whose cost does not grow with depth.

A page is `ORDER BY <sort column>, id LIMIT n`; the next page starts strictly after the last
row's (value, id), which an index on the sort column (or the primary key) finds directly, where
OFFSET would read and throw away every earlier row. The cursor that says where to start is an
opaque URL-safe string: base64 of `[sort key, last value, last id]`.

NULLs (a run's started_at before it starts) sort last in both directions, on SQLite and Postgres
alike, so the cursor conditions below hold for nullable columns too.

Counts are exact up to COUNT_CAP matching rows. Beyond it they stop there and say so
(`count_exact: false`): counting 1,000,000 rows for a page of 50 costs more than the page.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi.exceptions import RequestValidationError
from sqlalchemy import BigInteger, ColumnElement, Select, and_, func, or_, select, tuple_
from sqlalchemy.orm import InstrumentedAttribute, Session

COUNT_CAP = 10_000
"""Counts stop here: above it a list answers `count: 10000, count_exact: false`."""


def query_error(field: str, reason: str) -> RequestValidationError:
    """A 422 naming one query parameter, shaped like FastAPI's own validation errors."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("query", field), "msg": reason, "input": None}]
    )


@dataclass(frozen=True)
class Cursor:
    """Where the next page starts: just after the row with this sort value and id."""

    sort: str
    value: Any
    id: int

    def encode(self) -> str:
        value = self.value.isoformat() if isinstance(self.value, datetime) else self.value
        raw = json.dumps([self.sort, value, self.id], separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _is_int(value: Any, bits: int = 32) -> bool:
    """An int (not a bool) that fits a signed column of `bits` bits."""
    limit = 2 ** (bits - 1)
    return isinstance(value, int) and not isinstance(value, bool) and -limit <= value < limit


def _column_value(value: Any, column: InstrumentedAttribute[Any]) -> Any:
    """A cursor's JSON value as the column's Python type; TypeError or ValueError if it cannot
    be one (a forged cursor must not reach the database as a mistyped comparison)."""
    if value is None:
        if not column.nullable:
            raise TypeError("NULL in a NOT NULL column")
        return None
    kind = column.type.python_type
    if kind is datetime:
        return datetime.fromisoformat(value)
    if kind is int:
        if not _is_int(value, 64 if isinstance(column.type, BigInteger) else 32):
            raise TypeError("not an integer the column holds")
        return value
    if not isinstance(value, str) or "\x00" in value:
        raise TypeError("not a string the column holds")
    return kind(value)  # str, or a StrEnum such as RunStatus (ValueError if not a member)


def decode_cursor(text: str, sort: str, column: InstrumentedAttribute[Any]) -> Cursor:
    """The cursor a previous page returned as `next`; a 422 naming `cursor` if it is not one,
    or if it was made for another sort order."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        key, value, last_id = json.loads(raw)
    except (binascii.Error, UnicodeDecodeError, ValueError, TypeError) as e:
        raise query_error("cursor", "not a cursor from a previous page's `next`") from e
    if key != sort:
        raise query_error("cursor", f"made for sort={key!r}, not sort={sort!r}")
    if not _is_int(last_id):
        raise query_error("cursor", "not a cursor from a previous page's `next`")
    try:
        value = _column_value(value, column)
    except (TypeError, ValueError) as e:
        raise query_error("cursor", "not a cursor from a previous page's `next`") from e
    return Cursor(key, value, last_id)


def order_by(
    column: InstrumentedAttribute[Any], id_column: InstrumentedAttribute[Any], desc: bool
) -> list[Any]:
    """ORDER BY column (NULLs last), id in the same direction: a total order for cursors.

    NULLS LAST is spelled out only for nullable columns: on a NOT NULL column it changes
    nothing, and without it Postgres can walk a plain index backwards for a descending page."""
    order = column.desc() if desc else column.asc()
    if column.nullable:
        order = order.nulls_last()
    return [order, id_column.desc() if desc else id_column.asc()]


def after(
    cursor: Cursor,
    column: InstrumentedAttribute[Any],
    id_column: InstrumentedAttribute[Any],
    desc: bool,
) -> ColumnElement[bool]:
    """The rows that come after `cursor` in order_by(column, id_column, desc)."""
    beyond = id_column < cursor.id if desc else id_column > cursor.id
    if cursor.value is None:  # the NULLs come last: only NULL rows with a later id remain
        return and_(column.is_(None), beyond)
    pair, last = tuple_(column, id_column), tuple_(cursor.value, cursor.id)
    later = pair < last if desc else pair > last
    if column.nullable:
        return or_(later, column.is_(None))
    return later


def capped_count_statement(query: Select[Any]) -> Select[Any]:
    """SELECT the number of rows of `query` (a select of the matching rows), stopping at
    COUNT_CAP + 1: it reads at most that many index entries whatever the table's size."""
    limited = query.with_only_columns(query.selected_columns[0]).limit(COUNT_CAP + 1).subquery()
    return select(func.count()).select_from(limited)


def capped(n: int) -> tuple[int, bool]:
    """A count read by capped_count_statement as (count up to COUNT_CAP, whether exact)."""
    return min(n, COUNT_CAP), n <= COUNT_CAP


def capped_count(session: Session, query: Select[Any]) -> tuple[int, bool]:
    """How many rows `query` (a select of the matching rows) has, up to COUNT_CAP; and whether
    that is exact."""
    return capped(session.scalar(capped_count_statement(query)) or 0)


COUNT_LABEL = "matched"
"""The column counted adds to a page's rows."""


def counted(statement: Select[Any], query: Select[Any]) -> Select[Any]:
    """`statement` (a page) with the capped count of `query` as one more column, COUNT_LABEL:
    the page and its count in one round trip. The count is an uncorrelated subquery, which
    Postgres (an InitPlan) and SQLite both run once per statement, not once per row."""
    return statement.add_columns(capped_count_statement(query).scalar_subquery().label(COUNT_LABEL))


def count_of(session: Session, rows: list[Any], query: Select[Any]) -> tuple[int, bool]:
    """The capped count of `query` as a `counted` page's rows carry it; counted on its own
    only when the page has no row to carry it (a filter that matches nothing, a skip past the
    end)."""
    if rows:
        return capped(rows[0]._mapping[COUNT_LABEL])
    return capped_count(session, query)


def page_statement(
    query: Select[Any],
    *,
    sort: str,
    column: InstrumentedAttribute[Any],
    id_column: InstrumentedAttribute[Any],
    cursor: str | None,
    skip: int,
    limit: int,
) -> Select[Any]:
    """`query` ordered by `sort` (a '-' prefix: descending), from just after `cursor` (or from
    `skip`), for `limit` rows and one more that tells whether a next page exists."""
    desc = sort.startswith("-")
    if cursor is not None:
        query = query.where(after(decode_cursor(cursor, sort, column), column, id_column, desc))
    return query.order_by(*order_by(column, id_column, desc)).offset(skip).limit(limit + 1)


def page_of(
    session: Session,
    statement: Select[Any],
    *,
    sort: str,
    column: InstrumentedAttribute[Any],
    id_column: InstrumentedAttribute[Any],
    limit: int,
) -> tuple[list[Any], str | None]:
    """The rows of `statement` (a page_statement of `limit` rows and one more, or a select
    of wider rows ordered by one) and the cursor of the page after it (None on the last page).
    The statement's selected columns must include `column` and `id_column`."""
    rows = session.execute(statement).all()
    if len(rows) <= limit:
        return list(rows), None
    rows = rows[:limit]
    last = rows[-1]._mapping
    return list(rows), Cursor(sort, last[column.key], last[id_column.key]).encode()
