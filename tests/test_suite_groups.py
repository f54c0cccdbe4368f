"""The suite's own arrangement (scripts/test.sh): under pytest-xdist with --dist loadgroup, every
test that uses or starts a Ray carries one of tests/conftest.py's RAY_GROUPS in its node id, so
each group runs on one worker with one local Ray. pytest 9.2 silently dropped that suffix
(pytest-xdist#1386: the tests were spread over both workers, each starting a Ray); this test
fails if an upgrade drops it again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import RAY_B_FILES, RAY_GROUPS, ray_group


@pytest.mark.ray_process
def test_a_ray_test_runs_in_its_ray_group_under_xdist(request: pytest.FixtureRequest) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("not under pytest-xdist (scripts/test.sh runs it there)")
    group = ray_group("tests/test_suite_groups.py")
    assert group in RAY_GROUPS
    assert request.node.nodeid.endswith(f"@{group}"), request.node.nodeid


def test_the_second_group_names_ray_test_files_that_exist() -> None:
    root = Path(__file__).resolve().parents[1]
    missing = sorted(p for p in RAY_B_FILES if not (root / p).is_file())
    assert missing == [], f"RAY_B_FILES names files that are gone: {missing}"
    not_ray = sorted(p for p in RAY_B_FILES if "ray" not in (root / p).read_text())
    assert not_ray == [], f"RAY_B_FILES names files with no Ray test: {not_ray}"


def test_other_tests_are_in_no_group(request: pytest.FixtureRequest) -> None:
    assert "@" not in request.node.nodeid
