"""Settings read from the environment (prefix RINGLAB_), validated once at start-up."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, fields
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


@dataclass(frozen=True)
class RunLimits:
    """Server-side caps on what one sweep may ask of the cluster (RINGLAB_MAX_*): a cell over
    one is refused at submit with a 422 naming the field and the cap, so no request holds
    ranks for a day-long timeout, a billion iterations or a 2^63 batch."""

    timeout_s: float = 86_400.0
    iterations: int = 10_000
    warmup: int = 1_000
    batch_size: int = 65_536
    elements: int = 1 << 40
    cells: int = 100_000


class Settings(BaseSettings):
    """Everything a ringlab process reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="RINGLAB_", extra="ignore")

    database_url: str = Field(default_factory=default_database_url)
    ray_address: str | None = None
    api_token: str | None = None
    require_token_for_reads: bool = False
    session_ttl_s: float = Field(
        default=12 * 3600.0,
        gt=0,
        le=30 * 24 * 3600.0,
        allow_inf_nan=False,
        description="How long a dashboard login lasts (its cookie's and its stored expiry).",
    )
    max_concurrent_runs: int | None = Field(
        default=None,
        ge=1,
        description="The most runs one scheduler drives at once (None: as many as the "
        "cluster's free resources hold).",
    )
    warm_gang_ttl_s: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description="How long a warm gang (kept for the next run of its shape) may stay idle "
        "before its resources go back to Ray; one is given back at once when Ray has "
        "pending demand it could serve.",
    )
    host: str = "127.0.0.1"
    allowed_hosts: str | None = Field(
        default=None,
        description="Comma-separated Host names the server answers to ('*': any); unset: "
        "loopback names and the address it binds (allowed_host_names).",
    )
    port: int = Field(default=8000, ge=1, le=65535)
    artifact_root: str = Field(
        default_factory=default_artifact_root,
        description="Where runs' artifacts are written: a directory or an fsspec URL.",
    )
    artifact_max_bytes: int = Field(default=64 << 20, ge=1)
    run_artifacts_max_bytes: int = Field(default=256 << 20, ge=1)
    max_timeout_s: float = Field(
        default=RunLimits.timeout_s,
        gt=0,
        allow_inf_nan=False,
        description="Cap on a cell's timeout_s and dist_timeout_s.",
    )
    max_iterations: int = Field(
        default=RunLimits.iterations, ge=1, description="Cap on an integer `iterations`."
    )
    max_warmup: int = Field(default=RunLimits.warmup, ge=0, description="Cap on `warmup`.")
    max_batch_size: int = Field(default=RunLimits.batch_size, ge=1, description="Cap on batch.")
    max_elements: int = Field(
        default=RunLimits.elements,
        ge=1,
        description="Cap on seq_len x num_heads x head_dim (a search's max for seq_len).",
    )
    max_cells: int = Field(default=RunLimits.cells, ge=1, description="Cap on cells per sweep.")

    @field_validator("database_url")
    @classmethod
    def _normalize(cls, value: str) -> str:
        return normalize_database_url(value)

    @field_validator("ray_address", "api_token")
    @classmethod
    def _blank_is_unset(cls, value: str | None) -> str | None:
        return value or None

    def run_limits(self) -> RunLimits:
        """The caps a submitted sweep is held to (service.spec): each RunLimits field from its
        setting max_<field> (RINGLAB_MAX_<FIELD>)."""
        return RunLimits(**{f.name: getattr(self, f"max_{f.name}") for f in fields(RunLimits)})


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or `localhost`; a wildcard
    (0.0.0.0, ::, empty) or any other name or address is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")


def _machine_names() -> set[str]:
    """This machine's host name, its fully qualified name and the addresses they resolve to:
    what a client reaching a server bound to every address may call it."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:  # a host name that does not resolve: its name alone
            continue
    return {n.lower() for n in names if n}


def allowed_host_names(settings: Settings) -> frozenset[str] | None:
    """The Host names (no port, lower case, IPv6 without brackets) requests may carry; None:
    any (RINGLAB_ALLOWED_HOSTS=*). Unset: the loopback names and settings.host, and for a
    wildcard bind (0.0.0.0, ::) this machine's names and addresses. A foreign Host is what a
    DNS-rebinding page sends, so it is refused (service.api.security.SiteGuard)."""
    if settings.allowed_hosts is not None:
        names = {n.strip().lower().strip("[]") for n in settings.allowed_hosts.split(",")}
        names.discard("")
        return None if "*" in names else frozenset(names)
    names = {*LOOPBACK_NAMES, settings.host.lower().strip("[]")}
    if settings.host in WILDCARD_BINDS:
        names |= _machine_names()
    names.discard("")
    return frozenset(names)


def exposure_problem(settings: Settings, host: str, *, insecure: bool = False) -> str | None:
    """Why a server with `settings` must not start on `host`, in one line, or None.

    Fails closed: reads locked without a token would admit everyone (there is nothing to
    check against), and a non-loopback address without a token lets anyone who reaches it
    submit runs on the cluster (--insecure: the operator says the network is the guard)."""
    if settings.require_token_for_reads and settings.api_token is None:
        return (
            "RINGLAB_REQUIRE_TOKEN_FOR_READS=true needs RINGLAB_API_TOKEN (without a token "
            "there is nothing to check, and reads would stay open); set RINGLAB_API_TOKEN"
        )
    if settings.api_token is None and not is_loopback(host) and not insecure:
        return (
            f"refusing to serve on {host or '(all addresses)'} without RINGLAB_API_TOKEN: "
            "anyone who reaches it could submit and delete sweeps; set RINGLAB_API_TOKEN, "
            "listen on 127.0.0.1, or pass --insecure"
        )
    return None


@lru_cache
def get_settings() -> Settings:
    """The process' settings, read once."""
    return Settings()
