"""`ringlab export SWEEP --to mlflow|wandb|tensorboard` against a live service holding a stored
sweep (two runs, one of two ranks): each tool's local store is written twice (the second export
must update, never duplicate) and read back with that tool's own reader: MlflowClient on a file
store, the records of W&B's offline run files (wandb's Record type), TensorBoard's
EventAccumulator."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _api_helpers import store_result
from _wandb_reader import run_data
from _web_helpers import live_server, make_web_app
from typer.testing import CliRunner

from service import cli
from service.cli import console
from service.core.config import Settings
from service.db.engine import make_engine, make_sessionmaker
from service.db.models import ArtifactRow, Environment

pytestmark = pytest.mark.timeout(300)
API = "/api/v1"
SPEC = {
    "name": "export me",
    "base": {"kernel": "dense", "num_heads": 2, "head_dim": 16, "batch_size": 2,
             "parallel": "data", "device": "cpu", "iterations": 3, "seq_len": 128},
    "grid": {"world_size": [1, 2]},
}  # fmt: skip
MEDIANS = {1: (0.010,), 2: (0.006, 0.007)}
CODE = {"ext-kernels": {"git_sha": "feedbeef", "git_dirty": True, "path": "/src/ext"}}
TRACE = b'{"traceEvents": []}'


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('export') / 'ringlab.db'}"
    with live_server(make_web_app(Settings(database_url=url))) as base:
        sweep = httpx.post(f"{base}{API}/sweeps", json=SPEC).json()["id"]
        runs = httpx.get(f"{base}{API}/runs", params={"sweep_id": sweep}).json()["data"]
        engine = make_engine(url)
        with make_sessionmaker(engine)() as session:
            for run in runs:
                store_result(session, run["id"], medians=MEDIANS[run["world_size"]])
            env = session.query(Environment).one()
            env.plugin_code = CODE
            trace = tmp_path_factory.mktemp("artifacts") / "trace-rank0.json"
            trace.write_bytes(TRACE)
            one = next(r["id"] for r in runs if r["world_size"] == 1)
            session.add(ArtifactRow(run_id=one, rank=0, name="trace-rank0.json",
                                 kind="chrome_trace", size_bytes=len(TRACE),
                                 location=str(trace)))  # fmt: skip
            session.commit()
        engine.dispose()
        yield base, sweep


@pytest.fixture
def expected(service: tuple[str, int]) -> dict[str, Any]:
    """What the service says: results.json rows and each run's rank peaks, by run id."""
    base, sweep = service
    rows = httpx.get(f"{base}{API}/sweeps/{sweep}/results.json").json()
    assert len(rows) == 2
    return {
        "rows": {r["run_id"]: r for r in rows},
        "report": httpx.get(f"{base}{API}/sweeps/{sweep}/report.md").text,
    }


def export_twice(service: tuple[str, int], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    base, sweep = service
    monkeypatch.setenv("RINGLAB_URL", base)
    monkeypatch.setattr(console.out, "width", 300)
    outputs = []
    for _ in range(2):
        result = CliRunner().invoke(cli.app, ["export", str(sweep), *args],
                                    catch_exceptions=False)  # fmt: skip
        assert result.exit_code == 0, result.stdout + result.stderr
        outputs.append(result.stdout)
    return "\n".join(outputs)


def test_mlflow_file_store(service: Any, expected: dict[str, Any], tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    store = tmp_path / "mlruns"
    said = export_twice(service, monkeypatch, "--to", "mlflow", "--uri", str(store))
    assert "2 runs created, 0 updated" in said and "0 runs created, 2 updated" in said
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name.startswith("ringlab")]
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2  # the second export updated them
    for run in runs:
        row = expected["rows"][int(run.data.tags["ringlab.run_id"])]
        assert run.data.params["world_size"] == str(row["world_size"])
        assert run.data.params["kernel"] == "dense" and "name" not in run.data.params
        assert run.data.metrics["time_median_s"] == pytest.approx(row["median_s"])
        assert run.data.metrics["tokens_per_s"] == pytest.approx(row["tokens_per_s"])
        assert run.data.metrics["tflops_per_s"] == pytest.approx(row["tflops_per_s"])
        assert run.data.metrics["peak_memory_bytes"] == row["peak_memory_bytes"]
        # how much a time is worth: its iteration count and its interval's level go too
        assert run.data.metrics["iterations"] == row["iterations"] > 0
        assert run.data.metrics["time_median_ci_level"] == pytest.approx(row["median_ci_level"])
        history = client.get_metric_history(run.info.run_id, "rank_peak_memory_bytes")
        assert sorted((m.step, m.value) for m in history) == list(enumerate(row["rank_peak_bytes"]))
        assert len(client.get_metric_history(run.info.run_id, "time_median_s")) == 1
        assert run.data.tags["env.git_sha"] == "abc1234"
        assert json.loads(run.data.tags["env.plugin_code"]) == CODE
        path = client.download_artifacts(run.info.run_id, "report.md", str(tmp_path / "dl"))
        assert Path(path).read_text() == expected["report"]
        traces = [a.path for a in client.list_artifacts(run.info.run_id, "artifacts")]
        assert traces == (["artifacts/trace-rank0.json"] if row["world_size"] == 1 else [])
    (traced,) = [r for r in runs if r.data.params["world_size"] == "1"]
    path = client.download_artifacts(
        traced.info.run_id, "artifacts/trace-rank0.json", str(tmp_path)
    )
    assert Path(path).read_bytes() == TRACE


def test_tensorboard_event_files(service: Any, expected: dict[str, Any], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    export_twice(service, monkeypatch, "--to", "tensorboard", "--uri", str(tmp_path))
    root = tmp_path / f"ringlab-sweep-{service[1]}"
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["report", *(f"run-{i}" for i in expected["rows"])]
    )
    for run_id, row in expected["rows"].items():
        events = EventAccumulator(str(root / f"run-{run_id}"), size_guidance={"tensors": 0})
        events.Reload()
        peaks = events.Scalars("rank_peak_memory_bytes")
        assert [(e.step, e.value) for e in peaks] == list(enumerate(row["rank_peak_bytes"]))
        (median,) = events.Scalars("time_median_s")  # once: the first export's files are gone
        assert median.value == pytest.approx(row["median_s"], rel=1e-6)
        (tags,) = events.Tensors("tags/text_summary")
        assert "env.git_sha | abc1234" in tags.tensor_proto.string_val[0].decode()
    report = EventAccumulator(str(root / "report"), size_guidance={"tensors": 0})
    report.Reload()
    (text,) = report.Tensors("report.md/text_summary")
    assert text.tensor_proto.string_val[0].decode() == expected["report"]


def test_wandb_offline_run_files(service: Any, expected: dict[str, Any], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    export_twice(service, monkeypatch, "--to", "wandb", "--uri", str(tmp_path))
    dirs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2  # one per run: the second export replaced the first's
    for directory in dirs:
        (file,) = directory.glob("run-*.wandb")
        data = run_data(file)
        config = data["config"]
        row = expected["rows"][int(config["environment"]["ringlab.run_id"])]
        assert config["world_size"] == str(row["world_size"]) and config["kernel"] == "dense"
        assert data["summary"]["time_median_s"] == pytest.approx(row["median_s"])
        assert data["summary"]["tokens_per_s"] == pytest.approx(row["tokens_per_s"])
        peaks = [(step, h["rank_peak_memory_bytes"]) for step, h in sorted(data["history"].items())]
        assert peaks == list(enumerate(row["rank_peak_bytes"]))
        assert json.loads(config["environment"]["env.plugin_code"]) == CODE
        assert (directory / "files" / "report.md").read_text() == expected["report"]
        trace = directory / "files" / "artifacts" / "trace-rank0.json"
        assert trace.exists() == (row["world_size"] == 1)
        assert row["world_size"] != 1 or trace.read_bytes() == TRACE


def test_a_bad_target_is_one_line(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLAB_URL", service[0])
    result = CliRunner().invoke(cli.app, ["export", str(service[1]), "--to", "neptune"])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line == "error: --to: one of mlflow, wandb, tensorboard, got 'neptune'"
    result = CliRunner().invoke(cli.app, ["export", str(service[1])])
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: --to: one of mlflow, wandb, tensorboard, got nothing"
