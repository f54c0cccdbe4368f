"""`ringlab db upgrade|downgrade|current`: the schema of the configured database
(RINGLAB_DATABASE_URL), and the settings and shown URL every process command starts from."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Annotated

import typer
from sqlalchemy.engine import make_url

from service.cli.console import friendly_errors, out
from service.core.config import Settings


def load_settings() -> Settings:
    """Settings from the environment; a bad value becomes a CliError-style exit."""
    return Settings()


def safe_url(settings: Settings) -> str:
    """The database URL with any password hidden."""
    return make_url(settings.database_url).render_as_string(hide_password=True)


def migrations() -> ModuleType:
    """service.db.migrate (upgrade, downgrade, current), imported when a command first needs it."""
    from service.db import migrate  # alembic: ~130 ms, kept off the CLI's start-up

    return migrate


def _migrate(step: Callable[[str, str], object], revision: str) -> None:
    """Run `step` (migrate.upgrade or downgrade) on the configured database to `revision` and
    print the revision it is at afterwards."""
    settings = load_settings()
    step(settings.database_url, revision)
    current = migrations().current(settings.database_url)
    out.print(f"database at revision {current}: {safe_url(settings)}")


@friendly_errors
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Bring the database (RINGLAB_DATABASE_URL) to the latest schema."""
    _migrate(migrations().upgrade, revision)


@friendly_errors
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' empties it).")],
) -> None:
    """Take the database back to an earlier revision."""
    _migrate(migrations().downgrade, revision)


@friendly_errors
def db_current() -> None:
    """Print the database's current revision."""
    settings = load_settings()
    out.print(migrations().current(settings.database_url) or "empty (no revision)")
