"""What every `ringlab` command shares: the two consoles, the one-line error (CliError,
friendly_errors) and the HTTP client. Each command module imports this one, none imports
another's internals, and service.cli.commands registers them all on the app."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

from service.client import Client, ClientError

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])


class CliError(Exception):
    """An error to show the user as one line (and, for a file, the offending line below it)."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


def one_line(exc: BaseException) -> str:
    """The first line of an error as the user reads it: a bad setting, database or URL named."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "settings"
        field = f"RINGLAB_{loc.upper()}" if first["loc"] else loc
        return f"invalid setting {field}: {first['msg'].removeprefix('Value error, ')}"
    if isinstance(exc, OperationalError):
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        return f"cannot reach the database: {reason}"
    if isinstance(exc, NoSuchModuleError | ArgumentError):
        return f"bad database URL: {exc}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def friendly_errors(fn: F) -> F:
    """Turn known failures into one red line on stderr and exit code 1."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (
            CliError,
            ClientError,
            ValidationError,
            OperationalError,
            NoSuchModuleError,
            ArgumentError,
            ConnectionError,  # Ray: no cluster at RINGLAB_RAY_ADDRESS
        ) as e:
            err.print(f"[red]error:[/red] {escape(one_line(e))}")
            if isinstance(e, CliError | ClientError) and e.detail:
                err.print(e.detail, markup=False)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def client() -> Any:
    """A client for RINGLAB_URL with RINGLAB_API_TOKEN."""
    return Client()
