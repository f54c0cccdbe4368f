"""Values a submitted document may hold: what every database the service runs on stores and
reads back as given (no NUL, no lone surrogate, no NaN, no integer beyond 2^53 - 1), nested no
deeper than MAX_DEPTH."""

from __future__ import annotations

import math
from typing import Any

from service.spec_fields import MAX_ERRORS, Loc, err, shown_key

MAX_JSON_INT = 2**53 - 1
"""The largest integer every JSON reader holds exactly (a double's 53 bits); any larger is no
size or count a run can mean (window 2^62, batch_size 2^63), so it is refused, not stored."""
MAX_DEPTH = 32
"""Deepest nesting of objects and lists a spec may have (real specs nest 4 levels)."""


def _string_problem(text: str) -> tuple[str, str] | None:
    """(message, type) when `text` cannot be stored or sent back as UTF-8 text, else None."""
    if "\x00" in text:
        return "must not contain NUL (\\x00) characters", "string_nul"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"holds a lone surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, "
            "which is no Unicode text",
            "string_unicode",
        )
    return None


def _scalar_problem(value: Any) -> tuple[str, str] | None:
    """(message, type) for a string, number or key that no database column or JSON reader
    holds as given: NUL, a lone surrogate, NaN or an infinity, an integer beyond 2^53 - 1."""
    if isinstance(value, str):
        return _string_problem(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}", "finite_number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_JSON_INT:
        return f"must be within +-{MAX_JSON_INT:,} (2^53 - 1), got {value:.3g}", "int_too_big"
    return None


def unstorable_values(value: Any, loc: Loc = ()) -> list[dict[str, Any]]:
    """Errors (pydantic's shape) for every value or key of a submitted document that cannot
    be stored and read back as given (_scalar_problem), and for nesting deeper than MAX_DEPTH.

    Checked before anything is expanded or stored, so every database the service runs on
    (Postgres refuses NUL and lone surrogates in text) answers one 422 with the path, never a
    500. Iterative: a hostile depth cannot exhaust the interpreter's stack."""
    found: list[dict[str, Any]] = []
    stack: list[tuple[Any, Loc]] = [(value, loc)]
    while stack and len(found) <= MAX_ERRORS:
        item, where = stack.pop()
        if isinstance(item, dict | list | tuple) and len(where) - len(loc) >= MAX_DEPTH:
            found.append(err(where, f"nested deeper than {MAX_DEPTH} levels", "too_deep"))
            continue
        if isinstance(item, dict):
            for key, sub in reversed(item.items()):
                shown = (*where, shown_key(key))
                if (problem := _scalar_problem(key)) is not None:
                    found.append(err(shown, f"key {problem[0]}", problem[1]))
                stack.append((sub, shown))
        elif isinstance(item, list | tuple):
            stack.extend((sub, (*where, i)) for i, sub in reversed(list(enumerate(item))))
        elif (problem := _scalar_problem(item)) is not None:
            found.append(err(where, *problem))
    return found
