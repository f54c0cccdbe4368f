"""The wheelhouse check (scripts/device_wheels.py): every carried wheel's Requires-Dist met, with
its specifier, by a carried wheel or by the GPU machine's listed version; an unknown version on
the machine never meets a specifier. Real wheels: tiny ones built here with their METADATA."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _wheels_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "device_wheels", ROOT / "scripts" / "device_wheels.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheels = _wheels_module()


def wheel(folder: Path, name: str, version: str, *needs: str) -> Path:
    """A wheel of `name` `version` whose METADATA requires `needs` (pip's own layout)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {n}\n" for n in needs)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        zf.writestr(f"{name}/__init__.py", "")
    return path


MACHINE = {
    "typing-extensions": None,
    "protobuf": Version("5.29.0"),
    "torch": Version("2.11.0+cu130"),
}
"""A machine with typing-extensions of unknown version, protobuf 5.29.0 and torch 2.11."""


def test_a_need_met_by_the_machine_s_version_passes(tmp_path: Path) -> None:
    whl = wheel(tmp_path, "app", "1.0", "torch>=2.4", "protobuf<6,>=5")
    assert wheels.closure_problems([whl], MACHINE) == []


def test_a_version_the_machine_has_too_old_fails_naming_the_package(tmp_path: Path) -> None:
    whl = wheel(tmp_path, "app", "1.0", "protobuf>=6.31")
    (problem,) = wheels.closure_problems([whl], MACHINE)
    assert (
        problem == "app-1.0-py3-none-any.whl needs protobuf>=6.31: the machine has protobuf 5.29.0"
    )


def test_an_unknown_version_never_meets_a_specifier(tmp_path: Path) -> None:
    whl = wheel(tmp_path, "pydantic_core", "2.50.4", "typing-extensions>=4.14.1")
    (problem,) = wheels.closure_problems([whl], MACHINE)
    assert "typing-extensions>=4.14.1" in problem and "unknown version: carry a wheel" in problem
    # a need without a specifier accepts any version: the name is enough
    bare = wheel(tmp_path, "other", "1.0", "typing-extensions")
    assert wheels.closure_problems([bare], MACHINE) == []


def test_a_carried_wheel_meets_the_need_by_its_own_version(tmp_path: Path) -> None:
    need = wheel(tmp_path, "pydantic_core", "2.50.4", "typing-extensions>=4.14.1")
    good = wheel(tmp_path, "typing_extensions", "4.15.0")
    assert wheels.closure_problems([need, good], MACHINE) == []
    good.unlink()
    old = wheel(tmp_path, "typing_extensions", "4.12.2")
    (problem,) = wheels.closure_problems([need, old], MACHINE)
    assert problem.endswith("the wheelhouse has typing-extensions 4.12.2")


def test_markers_are_the_machine_s_and_a_missing_package_is_named(tmp_path: Path) -> None:
    whl = wheel(
        tmp_path,
        "app",
        "1.0",
        'tomli>=1; python_version < "3.11"',
        'rich; extra == "cli"',
        "nothere>=1",
    )
    (problem,) = wheels.closure_problems([whl], MACHINE)
    assert (
        problem
        == "app-1.0-py3-none-any.whl needs nothere>=1: not in the wheelhouse nor the machine"
    )


def test_the_machine_s_list_records_a_version_for_every_package() -> None:
    listed = wheels.device_packages()
    assert listed["torch"] == Version("2.11.0+cu130") and listed["triton"] == Version("3.6.0")
    assert listed["numpy"] == Version("2.5.2") and listed["typing-extensions"] is None
    assert len(listed) > 150
    header = "".join(ln for ln in wheels.DEVICE_PACKAGES.read_text().splitlines() if ln[:1] == "#")
    assert not re.search(r"(^|[\s(])/[a-z]", header), "the header names a path outside the project"


def test_a_line_without_a_version_is_an_error_naming_it(tmp_path: Path) -> None:
    listed = tmp_path / "packages.txt"
    listed.write_text("# header\nnumpy 2.5.2\nrich\n")
    with pytest.raises(ValueError, match="line 3: 'rich' is not 'NAME VERSION'"):
        wheels.device_packages(listed)


def test_the_check_command_prints_the_problem_and_exits_1(tmp_path: Path) -> None:
    wheel(tmp_path, "app", "1.0", "numpy>=99")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_wheels.py"), "check", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    want = "app-1.0-py3-none-any.whl needs numpy>=99: the machine has numpy 2.5.2"
    assert f"wheelhouse check failed: {want}" in done.stderr


def test_repack_drops_what_is_never_loaded_and_keeps_the_rest_and_its_record(
    tmp_path: Path,
) -> None:
    path = tmp_path / "plotly-7.1.0-py3-none-any.whl"
    kept = [
        "plotly/__init__.py",
        "plotly/package_data/plotly.min.js",
        "plotly-7.1.0.dist-info/METADATA",
    ]
    dropped = ["plotly/package_data/widgetbundle.js", "plotly/labextension/static/a.js",
               "plotly-7.1.0.data/data/share/jupyter/labextensions/x.js"]  # fmt: skip
    record = "".join(f"{n},,\n" for n in kept + dropped)
    with zipfile.ZipFile(path, "w") as zf:
        for n in kept + dropped:
            zf.writestr(n, "x")
        zf.writestr("plotly-7.1.0.dist-info/RECORD", record)
    wheels.repack(path)
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == sorted([*kept, "plotly-7.1.0.dist-info/RECORD"])
        lines = zf.read("plotly-7.1.0.dist-info/RECORD").decode().splitlines()
    assert lines == [f"{n},," for n in kept]
