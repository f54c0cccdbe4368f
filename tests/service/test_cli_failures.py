"""Failures told where the user looks: `ringlab results` has a status column and each run not
ok with its one-line reason (at 80 columns too), `ringlab watch` names the reasons, a search
whose runs were infeasible says so, and `ringlab submit` warns of runs the cluster cannot hold
(its dry run too). Read as printed, against a live service (no scheduler: the runs' ends are
written here)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from _api_helpers import cluster_once_connected
from _web_helpers import live_server, make_web_app
from typer.testing import CliRunner

from service import capacity
from service.cli import app, console
from service.core.config import Settings
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import upgrade
from service.db.models import Run, RunStatus

pytestmark = pytest.mark.timeout(180)
runner = CliRunner()
INFEASIBLE = (
    "infeasible: the run needs 4 CPU (world_size=4, one CPU per rank, device=cpu); the cluster "
    "has 2 CPU in total on 1 node(s) (127.0.0.1: 2 CPU)"
)
CPU_4 = {"kernel": "ring", "world_size": 4, "device": "cpu", "num_heads": 2, "head_dim": 16}


def _fail_runs(url: str, sweep_id: int, error: str) -> list[int]:
    """End every run of the sweep failed with `error`, as the scheduler does an infeasible one."""
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            runs = session.query(Run).filter(Run.sweep_id == sweep_id).order_by(Run.id).all()
            for run in runs:
                run.status, run.error = RunStatus.failed, error
                run.finished_at = datetime.now(UTC)
            session.commit()
            return [r.id for r in runs]
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def failed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int]]]:
    """A live service holding a benchmark and a max_seq_len sweep of 4-rank CPU runs, all
    failed as infeasible; (its URL, {"bench", "search", "bench_run", "search_run"})."""
    url = f"sqlite:///{tmp_path_factory.mktemp('failures') / 'ringlab.db'}"
    upgrade(url)
    with live_server(make_web_app(Settings(database_url=url))) as base:
        bench = {"name": "four ranks", "base": {**CPU_4, "seq_len": 256}}
        search = {"name": "four ranks, longest", "kind": "max_seq_len", "base": CPU_4,
                  "search": {"start": 256, "max": 1024, "granularity": 256}}  # fmt: skip
        ids = {k: httpx.post(f"{base}/api/v1/sweeps", json=s).json()["id"]
               for k, s in (("bench", bench), ("search", search))}  # fmt: skip
        ids["bench_run"] = _fail_runs(url, ids["bench"], INFEASIBLE)[0]
        ids["search_run"] = _fail_runs(url, ids["search"], INFEASIBLE)[0]
        yield base, ids


def _ringlab_80(base: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`ringlab ARGS` as a user runs it in an 80-column terminal."""
    command = [str(Path(sys.executable).parent / "ringlab"), *args]
    env = {**os.environ, "RINGLAB_URL": base, "COLUMNS": "80"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def _point_cli(
    monkeypatch: pytest.MonkeyPatch, base: str, out: int | None = None, err: int | None = None
) -> None:
    """The in-process CLI talks to the server at `base`, its stdout and stderr consoles `out`
    and `err` columns wide where given (so messages do not wrap)."""
    monkeypatch.setenv("RINGLAB_URL", base)
    for stream, width in ((console.out, out), (console.err, err)):
        if width is not None:
            monkeypatch.setattr(stream, "width", width)


def test_results_has_a_status_column_and_each_failed_runs_reason(
    failed: tuple[str, dict[str, int]],
) -> None:
    base, ids = failed
    done = _ringlab_80(base, "results", str(ids["bench"]))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "configuration" in line)
    assert "status" in header.split()
    row = next(line for line in lines if line.startswith(str(ids["bench_run"])))
    assert "failed" in row.split()
    words = " ".join(done.stdout.split())  # the reason wraps at 80 columns, whole
    assert f"run {ids['bench_run']} failed: {INFEASIBLE}" in words


def test_watch_names_the_reason_of_failed_runs(
    failed: tuple[str, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, ids = failed
    _point_cli(monkeypatch, base, out=200, err=400)
    result = runner.invoke(app, ["watch", str(ids["bench"])], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"sweep {ids['bench']}, run {ids['bench_run']} failed: {INFEASIBLE}" in result.stderr


def test_a_search_whose_runs_were_infeasible_says_so(
    failed: tuple[str, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, ids = failed
    _point_cli(monkeypatch, base, out=400)
    result = runner.invoke(app, ["watch", str(ids["search"])], catch_exceptions=False)
    assert result.exit_code == 1
    assert "no length fit" not in result.stdout
    assert f"run {ids['search_run']} ring: {INFEASIBLE}" in result.stdout


def test_cannot_fit_names_the_capacity_and_the_runs() -> None:
    cluster = {"nodes": [{"ip": "10.0.0.1", "cpus": 2.0, "gpus": 0.0}], "total_cpus": 2.0,
               "total_gpus": 0.0}  # fmt: skip
    runs = [{"id": i, "config": {**CPU_4, "world_size": w}} for i, w in ((7, 2), (8, 4), (9, 4))]
    assert capacity.cannot_fit(cluster, runs) == [
        "warning: 2 of 3 runs cannot fit this cluster (2 CPU, 0 GPU on 1 node(s)); they will "
        "fail as infeasible:",
        "  runs 8, 9: the run needs 4 CPU (world_size=4, one CPU per rank, device=cpu)",
    ]
    assert capacity.cannot_fit(cluster, runs[:1]) == []


@pytest.mark.ray
def test_submit_warns_of_runs_the_cluster_cannot_hold(
    ray_session: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'ringlab.db'}"
    upgrade(url)
    spec = tmp_path / "wide.yaml"
    spec.write_text(
        "name: wide\nbase: {kernel: ring, device: cpu, num_heads: 2, head_dim: 16, seq_len: 256}\n"
        "grid: {world_size: [2, 64]}\n"
    )
    # an API-only process reports the cluster at its Ray address through its Ray driver
    address = ray_session.get_runtime_context().gcs_address  # type: ignore[attr-defined]
    settings = Settings(database_url=url, ray_address=address)
    with live_server(make_web_app(settings)) as base:
        cluster_once_connected(lambda path: httpx.get(f"{base}{path}"))
        _point_cli(monkeypatch, base, err=400)
        dry = runner.invoke(app, ["submit", "--dry-run", str(spec)], catch_exceptions=False)
        result = runner.invoke(app, ["submit", str(spec)], catch_exceptions=False)
    assert dry.exit_code == 0, dry.stderr  # a warning, not a problem: submitting stores both
    assert dry.stdout.splitlines()[0] == "documents[0] (wide): 2 cells, ok"
    warned = dry.stderr.strip().splitlines()
    assert warned[0].startswith("documents[0]: warning: 1 of 2 cells cannot fit this cluster (")
    assert warned[0].endswith(
        " CPU, 0 GPU on 1 node(s)); submitted, they would fail as infeasible:"
    )
    assert warned[1:] == [
        "  1 cell: the run needs 64 CPU (world_size=64, one CPU per rank, device=cpu)"
    ]
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("sweep 1: warning: 1 of 2 runs cannot fit this cluster (")
    assert " CPU, 0 GPU on 1 node(s)); they will fail as infeasible:" in lines[0]
    assert lines[1] == "  run 2: the run needs 64 CPU (world_size=64, one CPU per rank, device=cpu)"
