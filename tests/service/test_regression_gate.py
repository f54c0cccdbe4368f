"""The code version of a run and the regression gate, through the real service: three sweeps of
the test plugin `planted_dense` (tests/plugins) run by the scheduler on the session's local Ray,
the third with its planted 2x slowdown on. Each run's environment records the plugin's checkout
(its commit and dirty state), shown on the run page and in report.md; `ringlab compare A B
--fail-on-regression` exits 0 on two runs of the same code and 1 on the slowed one, naming the
cells that moved."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from _gang_helpers import run_queue
from _web_helpers import live_server, make_web_app
from typer.testing import CliRunner

from service import cli
from service.cli import console
from service.core.config import Settings

API = "/api/v1"
PLUGIN_DIR = Path(__file__).parents[1] / "plugins"
LENGTHS = (1024, 1536)


def _spec(name: str) -> dict[str, Any]:
    base = {"kernel": "planted_dense", "num_heads": 2, "head_dim": 32, "device": "cpu"}
    base |= {"mode": "forward", "warmup": 1}
    return {"name": name, "base": base, "grid": {"seq_len": list(LENGTHS)}}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=PLUGIN_DIR, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def _run_sweeps(base: str, app: Any, names: list[str]) -> list[int]:
    """Submit one sweep per name and run them all to the end with a real scheduler."""
    ids = [httpx.post(f"{base}{API}/sweeps", json=_spec(n)).json()["id"] for n in names]
    run_queue(app.state.sessionmaker)
    return ids


def _gate(base: str, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setenv("RINGLAB_URL", base)
    monkeypatch.setattr(console.out, "width", 200)
    return CliRunner().invoke(cli.app, ["compare", *args], catch_exceptions=False)


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_code_version_and_regression_gate_through_the_service(
    tmp_path: Path, ray_session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'gate.db'}")
    app = make_web_app(settings)
    with live_server(app) as base:
        a, b = _run_sweeps(base, app, ["reference", "same code"])

        @ray_session.remote(num_cpus=0)
        class Slowdown:
            def slowdown(self) -> int:
                return 2

        # the plugin imports attention's API: attention (imported above) loads it first
        from ringlab_test_plugins.planted import SLOWDOWN_ACTOR

        planted = Slowdown.options(name=SLOWDOWN_ACTOR).remote()
        try:
            (c,) = _run_sweeps(base, app, ["planted 2x slower"])
        finally:
            ray_session.kill(planted)
        rows = {s: httpx.get(f"{base}{API}/sweeps/{s}/results.json").json() for s in (a, b, c)}
        for sweep_rows in rows.values():
            assert [r["status"] for r in sweep_rows] == ["succeeded"] * len(LENGTHS), sweep_rows

        # the code version: the plugin's checkout, on the API, the run page and report.md
        sha = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "."))
        run_id = rows[c][0]["run_id"]
        env = httpx.get(f"{base}{API}/runs/{run_id}").json()["environment"]
        code = env["plugin_code"]["ringlab-test-plugins"]
        assert (code["git_sha"], code["git_dirty"]) == (sha, dirty)
        assert code["path"] == str(PLUGIN_DIR.resolve())
        assert "ringlab" not in env["plugin_code"]  # its version is env.git_sha
        assert env["git_sha"] == sha
        shown = f"ringlab-test-plugins {sha}" + (" (dirty)" if dirty else "")
        assert shown in httpx.get(f"{base}/runs/{run_id}").text
        assert shown in httpx.get(f"{base}{API}/sweeps/{c}/report.md").text

        # the cell's history: one run in each of the three sweeps, with that code version
        past = httpx.get(f"{base}{API}/cells/history", params={"run": run_id}).json()["entries"]
        assert [e["sweep_id"] for e in past] == [a, b, c]
        assert all(e["plugin_code"]["ringlab-test-plugins"]["git_sha"] == sha for e in past)

        # the gate: same code passes, the planted 2x slowdown fails and is named
        # 40%: a 4 ms cell on this shared 2-core machine moved 26% between identical sweeps
        # beside the other test worker; the planted slowdown doubles the work
        same = _gate(base, monkeypatch, str(a), str(b), "--fail-on-regression", "--threshold",
                     "40%")  # fmt: skip
        assert same.exit_code == 0, same.stdout + same.stderr
        assert "0 worse" in same.stdout
        slow = _gate(base, monkeypatch, str(a), str(c), "--fail-on-regression", "--threshold",
                     "40%")  # fmt: skip
        pairs = httpx.get(f"{base}{API}/sweeps/{a}/compare/{c}").json()["pairs"]
        assert slow.exit_code == 1, (slow.stdout, slow.stderr, pairs)
        lines = slow.stdout.splitlines()
        worse = [line for line in lines if line.startswith("worse ")]
        # each cell runs 2x the work; this shared 2-core machine's load can hide one of them
        assert worse and all("planted_dense · seq " in line for line in worse), slow.stdout
        assert not any(line.startswith("better ") for line in lines), slow.stdout
        ratios = [p["time_ratio"] for p in pairs]
        assert max(ratios) > 1.4, ratios
        print(f"planted B/A median ratios: {ratios}; gate output:\n{slow.stdout}")


def test_bad_gate_flags_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLAB_URL", "http://127.0.0.1:9")  # never reached: flags fail first
    for args, needle in [
        (["--threshold", "five"], "--threshold: a percentage such as 5% is needed, got 'five'"),
        (["--metric", "speed"], "--metric: one of median_s, tokens_per_s"),
    ]:
        result = _gate("http://127.0.0.1:9", monkeypatch, "1", "2", *args)
        assert result.exit_code == 1
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and needle in line, line


def test_git_state_counts_only_tracked_code_and_changes_below_a_plugin(tmp_path: Path) -> None:
    """A directory git ignores (an install under a repository's .venv) has no code version;
    a plugin's dirty state counts only changes under its own directory."""
    from workers.environment import git_state

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)  # fmt: skip

    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "k.py").write_text("x = 1\n")
    (tmp_path / "other.py").write_text("y = 1\n")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    (tmp_path / ".venv" / "site").mkdir(parents=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    (tmp_path / "other.py").write_text("y = 2\n")  # a change outside the plugin
    sha, dirty = git_state(tmp_path / "plugin", below=True)
    assert len(sha or "") == 40 and dirty is False
    assert git_state(tmp_path)[1] is True
    assert git_state(tmp_path / ".venv" / "site") == (None, None)
    (tmp_path / "plugin" / "k.py").write_text("x = 2\n")
    git_state.cache_clear()
    assert git_state(tmp_path / "plugin", below=True)[1] is True
