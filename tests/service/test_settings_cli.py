"""Settings normalization and the CLI's one-line errors for bad configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.core.config import Settings, normalize_database_url


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql://u:p@h:5433/db", "postgresql+psycopg://u:p@h:5433/db"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_database_url_is_normalized(raw: str, expected: str) -> None:
    assert normalize_database_url(raw) == expected


@pytest.mark.parametrize("raw", ["mysql://u@h/db", "just-a-path.db", "redis://localhost"])
def test_unknown_scheme_is_rejected(raw: str) -> None:
    with pytest.raises(ValueError, match=r"scheme|not a URL"):
        normalize_database_url(raw)


def test_default_database_is_sqlite_in_user_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGLAB_DATABASE_URL", raising=False)
    url = Settings().database_url
    assert url.startswith("sqlite:///") and url.endswith("ringlab/ringlab.db")


def _ringlab(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_db_upgrade_migrates_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sub' / 'r.db'}"
    res = _ringlab("db", "upgrade", env={"RINGLAB_DATABASE_URL": url})
    assert res.returncode == 0, res.stderr
    assert "revision 0001" in res.stdout or "revision" in res.stdout
    assert (tmp_path / "sub" / "r.db").exists()
    res = _ringlab("db", "current", env={"RINGLAB_DATABASE_URL": url})
    assert res.returncode == 0 and res.stdout.strip() != "empty (no revision)"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("mysql://root@127.0.0.1/test", "unsupported database scheme 'mysql'"),
        ("postgresql://nobody@127.0.0.1:1/none", "cannot reach the database"),
    ],
)
def test_bad_database_url_is_one_line_and_nonzero(url: str, needle: str) -> None:
    res = _ringlab("db", "upgrade", env={"RINGLAB_DATABASE_URL": url})
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.stderr
