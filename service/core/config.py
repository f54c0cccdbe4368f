"""Settings read from the environment (prefix RINGLAB_), validated once at start-up."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from platformdirs import user_data_dir
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SUPPORTED_SCHEMES = ("sqlite", "postgresql+psycopg")


def default_database_url() -> str:
    """A SQLite file in the user's data dir: the embedded default for a laptop."""
    return f"sqlite:///{Path(user_data_dir('ringlab')) / 'ringlab.db'}"


def default_artifact_root() -> str:
    """`artifacts` in the user's data directory, beside the default SQLite database."""
    return str(Path(user_data_dir("ringlab")) / "artifacts")


def normalize_database_url(url: str) -> str:
    """Map postgres:// and postgresql:// onto the psycopg 3 driver; reject other schemes.

    Raises ValueError naming the scheme and the supported ones.
    """
    url = url.strip()
    if "://" not in url:
        raise ValueError(f"not a URL: {url!r} (expected e.g. sqlite:///path or postgresql://...)")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme in ("postgres", "postgresql", "postgresql+psycopg"):
        return f"postgresql+psycopg://{rest}"
    if scheme in ("sqlite", "sqlite+pysqlite"):
        return f"sqlite://{rest}"
    raise ValueError(
        f"unsupported database scheme {scheme!r}; use sqlite:///path or postgresql://user@host/db"
    )


class Settings(BaseSettings):
    """Everything a ringlab process reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="RINGLAB_", extra="ignore")

    database_url: str = Field(default_factory=default_database_url)
    ray_address: str | None = None
    api_token: str | None = None
    require_token_for_reads: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    artifact_root: str = Field(
        default_factory=default_artifact_root,
        description="Where runs' artifacts are written: a directory or an fsspec URL.",
    )
    artifact_max_bytes: int = Field(default=64 << 20, ge=1)
    run_artifacts_max_bytes: int = Field(default=256 << 20, ge=1)

    @field_validator("database_url")
    @classmethod
    def _normalize(cls, value: str) -> str:
        return normalize_database_url(value)

    @field_validator("ray_address", "api_token")
    @classmethod
    def _blank_is_unset(cls, value: str | None) -> str | None:
        return value or None


@lru_cache
def get_settings() -> Settings:
    """The process' settings, read once."""
    return Settings()
