"""The suite's own arrangement (scripts/test.sh): under pytest-xdist with --dist loadgroup, every
test that uses or starts a Ray carries tests/conftest.py's RAY_GROUP in its node id, so one
worker runs them all with one local Ray. pytest 9.2 silently dropped that suffix
(pytest-xdist#1386: the tests were spread over both workers, each starting a Ray); this test
fails if an upgrade drops it again."""

from __future__ import annotations

import os

import pytest
from conftest import RAY_GROUP


@pytest.mark.ray_process
def test_a_ray_test_runs_in_the_ray_group_under_xdist(request: pytest.FixtureRequest) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("not under pytest-xdist (scripts/test.sh runs it there)")
    assert request.node.nodeid.endswith(f"@{RAY_GROUP}"), request.node.nodeid


def test_other_tests_are_in_no_group(request: pytest.FixtureRequest) -> None:
    assert "@" not in request.node.nodeid
