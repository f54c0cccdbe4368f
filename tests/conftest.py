"""Shared fixtures: a clean database per test on SQLite and on the real Postgres."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from service.core.config import normalize_database_url
from service.db.engine import make_engine, scratch_schema

POSTGRES_URL_ENV = "RINGLAB_TEST_POSTGRES_URL"


def _postgres_base_url() -> str | None:
    raw = os.environ.get(POSTGRES_URL_ENV)
    return normalize_database_url(raw) if raw else None


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL to an empty database: a fresh SQLite file, or a fresh schema in Postgres.

    The Postgres half is skipped, with a message, when RINGLAB_TEST_POSTGRES_URL is unset;
    CI sets it, so there both halves always run.
    """
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ringlab.db'}"
        return
    base = _postgres_base_url()
    if base is None:
        pytest.skip(f"{POSTGRES_URL_ENV} is unset: Postgres half skipped")
    with scratch_schema(base, "t_") as url:
        yield url


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """An engine on a clean database migrated to head."""
    from service.db.migrate import upgrade

    upgrade(database_url)
    eng = make_engine(database_url)
    try:
        yield eng
    finally:
        eng.dispose()


RAY_INIT_ARGS = {
    # A Ray of the test session's own, whatever cluster a `ray start` on this machine recorded.
    "address": "local",
    # Logical CPUs, more than this 2-core machine has: a 4-rank gloo gang fits, and issue 42's
    # concurrency criterion (8 one-rank cells, at least 4 at once) is tested on 8.
    "num_cpus": 8,
    "include_dashboard": False,
    "log_to_driver": False,
}


@pytest.fixture(scope="session")
def _ray_shutdown_at_end() -> Iterator[None]:
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_session(_ray_shutdown_at_end: None) -> Any:
    """The one local Ray of the test session (started on first use, shut down at the end).

    A test that needs its own cluster (ray.cluster_utils.Cluster) calls ray.shutdown() first and
    shuts its cluster down after; the next test using this fixture starts the local Ray again.
    """
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_INIT_ARGS)
    return ray


@pytest.fixture
def accumulator_windows(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """`accumulator_windows(units)`: merging kernels finish their rows in windows of `units`
    units (attention.primitive.windowed_result) for every dtype, fp32 and fp64 included, so
    that the fp64 references check the windowed forward that bf16 and fp16 take."""
    from attention import primitive

    def use(units: int) -> None:
        def windows(seq_len: int, dtype: Any, unit: int = 1) -> list[tuple[int, int]]:
            size = units * unit
            return [(c0, min(seq_len, c0 + size)) for c0 in range(0, seq_len, size)]

        monkeypatch.setattr(primitive, "windows", windows)

    return use


RAY_GROUPS = ("ray", "ray_b")
"""The xdist groups of the tests that use or start a Ray (scripts/test.sh runs two workers with
--dist loadgroup). A group runs on one worker, one test after another, with that worker's own
local Ray; the two groups run side by side, so one Ray test's waits (a gang starting, a timeout,
a killed head) overlap the other's. The other tests fill both workers around them."""

RAY_B_FILES = frozenset(
    {
        "tests/workers/test_gang.py",
        "tests/workers/test_gang_start.py",
        "tests/workers/test_cluster.py",
        "tests/workers/test_actor.py",
        "tests/test_device_check.py",
        "tests/test_suite_groups.py",
        "tests/service/test_scheduler_concurrent.py",
        "tests/service/test_warm_gangs_give_back.py",
        "tests/service/test_api_server.py",
        "tests/service/test_deploy_cluster.py",
        "tests/service/test_api.py",
        "tests/service/test_sp_schemes_service.py",
        "tests/service/test_own_ray.py",
        "tests/service/test_ring_steps_service.py",
        "tests/service/test_ray_unreachable.py",
        "tests/service/test_cli_failures.py",
        "tests/attention/test_plugins.py",
    }
)
"""The Ray test files of the second group: about half of the Ray tests' time (pytest
--durations on 2 cores); a new Ray test file joins the first group unless listed here."""


def ray_group(path: str) -> str:
    """The group of a Ray test in file `path` (relative to the repository root)."""
    return RAY_GROUPS[1] if path in RAY_B_FILES else RAY_GROUPS[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the tests that use the session's Ray (marker `ray`, fixture `ray_session`) or start
    one of their own (marker `ray_process`) in their RAY_GROUPS group."""
    for item in items:
        uses = "ray_session" in getattr(item, "fixturenames", ())
        if uses or item.get_closest_marker("ray") or item.get_closest_marker("ray_process"):
            path = item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(ray_group(path)))
