"""The `ringlab` client commands through typer's runner against a live service (uvicorn on a
free port, no scheduler) holding finished sweeps; errors are one line and exit code 1."""

from __future__ import annotations

import csv
import getpass
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _web_helpers import Seeded, live_server, make_web_app, seed_sweeps
from typer.testing import CliRunner

from service.cli import app, console
from service.core.config import Settings
from workers.results import ProbeResult

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Seeded]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'ringlab.db'}"
    seeded = seed_sweeps(url)
    with live_server(make_web_app(Settings(database_url=url))) as base:
        yield base, seeded


@pytest.fixture
def base(service: tuple[str, Seeded], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RINGLAB_URL", service[0])
    monkeypatch.delenv("RINGLAB_API_TOKEN", raising=False)
    monkeypatch.setattr(console.out, "width", 200)  # the runner is no terminal: rich would use 80
    return service[0]


def ringlab(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def one_error_line(result) -> str:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_ls_and_show(base: str, service: tuple[str, Seeded]) -> None:
    result = ringlab("ls")
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "kernels on 2x H100 (synthetic numbers)" in text and "max_seq_len" in text
    assert "17/17" in text and "succeeded 16, failed 1" in text
    result = ringlab("show", str(service[1].rerun))
    assert result.exit_code == 0, result.stderr
    assert f"dashboard: {base}/sweeps/{service[1].rerun}" in result.stdout
    assert "progress 17/17: succeeded 16, failed 1" in result.stdout


def test_results_in_three_formats(base: str, service: tuple[str, Seeded]) -> None:
    sweep = str(service[1].maxlen)
    rows = json.loads(ringlab("results", sweep, "--format", "json").stdout)
    assert sorted(r["max_seq_len"] for r in rows) == [1536, 1536, 2048, 4096]
    parsed = list(csv.DictReader(io.StringIO(ringlab("results", sweep, "-f", "csv").stdout)))
    assert [int(r["run_id"]) for r in parsed] == [r["run_id"] for r in rows]
    table = ringlab("results", sweep).stdout
    assert "block_sparse" in table and "4,096" in table
    assert "None" not in table and "max len" in table and "speedup" in table
    assert "--format" in one_error_line(ringlab("results", sweep, "--format", "xml"))


def test_results_table_fits_80_columns(base: str, service: tuple[str, Seeded]) -> None:
    """In an 80-column terminal the label wraps instead of every column being cut short."""
    command = [str(Path(sys.executable).parent / "ringlab"), "results", str(service[1].benchmark)]
    env = {**os.environ, "RINGLAB_URL": base, "COLUMNS": "80"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "configuration" in table and "tokens/s" in table and "W=1 (weak)" in table
    assert "0.047 ms" in table  # run 1's median, whole, in the table's unit (H100 numbers)
    assert "2.863 ms" in table and " us" not in table


def test_report_is_markdown(base: str, service: tuple[str, Seeded]) -> None:
    result = ringlab("report", str(service[1].benchmark))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("#") and "|" in result.stdout


def test_watch_exit_code_says_whether_a_run_failed(base: str, service: tuple[str, Seeded]) -> None:
    ok = ringlab("watch", str(service[1].benchmark))
    assert ok.exit_code == 0, ok.stderr
    assert "ended: succeeded 17" in ok.stdout
    bad = ringlab("watch", str(service[1].rerun))
    assert bad.exit_code == 1
    assert "1 run failed or timed out" in bad.stderr


def test_watch_of_a_sweep_deleted_meanwhile_fails_with_that_reason(base: str) -> None:
    """The last event of a deleted sweep is `end` with deleted: one line and exit 1, not an
    'ended' with the counts seen before."""
    import threading

    spec = {"name": "doomed", "base": {"kernel": "dense", "seq_len": 64, "device": "cpu"}}
    sweep_id = httpx.post(f"{base}/api/v1/sweeps", json=spec).json()["id"]
    deleter = threading.Timer(1.5, lambda: httpx.delete(f"{base}/api/v1/sweeps/{sweep_id}"))
    deleter.start()
    try:
        result = ringlab("watch", str(sweep_id))
    finally:
        deleter.join()
    assert result.exit_code == 1
    assert f"sweep {sweep_id} was deleted while watching" in result.stderr
    assert "ended" not in result.stdout


def test_submit_cancel_retry(base: str, service: tuple[str, Seeded], tmp_path: Path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        "name: tiny\nkind: benchmark\nbase: {kernel: dense, device: cpu, num_heads: 2}\n"
        "grid:\n  seq_len: [128, 256]\n"
    )
    result = ringlab("submit", str(spec))
    assert result.exit_code == 0, result.stderr
    first, second = result.stdout.strip().splitlines()
    sweep_id = int(first.split()[1])
    assert first == f"sweep {sweep_id} (tiny): 2 runs"
    assert second == f"dashboard: {base}/sweeps/{sweep_id}"
    assert httpx.get(f"{base}/sweeps/{sweep_id}").status_code == 200  # the page it points to
    api = f"{base}/api/v1/sweeps"
    assert httpx.get(f"{api}/{sweep_id}").json()["submitter"] == getpass.getuser()
    as_bob = ringlab("submit", str(spec), "--as", "bob", "--print-id")
    assert httpx.get(f"{api}/{as_bob.stdout.strip()}").json()["submitter"] == "bob"
    bad = one_error_line(ringlab("submit", str(spec), "--as", "bob smith"))
    assert "422" in bad and "x-ringlab-submitter" in bad
    again = ringlab("submit", str(spec), "--idempotency-key", "k1")
    again_twice = ringlab("submit", str(spec), "--idempotency-key", "k1")
    assert again.stdout == again_twice.stdout  # the same key returns the same sweep
    result = ringlab("cancel", str(sweep_id))
    assert result.stdout.strip() == f"sweep {sweep_id}: 2 runs cancelled"
    result = ringlab("retry", str(service[1].rerun))
    assert result.stdout.strip() == f"sweep {service[1].rerun}: 1 run requeued"


def test_client_errors_are_one_line(
    base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nbase: {kernel: nope, seq_len: 1024}\n")
    line = one_error_line(ringlab("submit", str(bad)))
    assert line.startswith(f"error: {bad}: nothing submitted: base.kernel: unknown kernel 'nope'")
    assert "404" in one_error_line(ringlab("show", "9999"))
    assert "no such file" in one_error_line(ringlab("submit", str(tmp_path / "missing.yaml")))
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    broken = ringlab("submit", str(tmp_path / "broken.yaml"))
    assert broken.exit_code == 1 and broken.stderr.splitlines() == [  # the place, then the line
        f"error: {tmp_path / 'broken.yaml'}:2:1: not valid YAML: expected ',' or ']', but got "
        "'<stream end>' (while parsing a flow sequence at line 1, column 7)",
        "  1 | name: [unclosed",
    ]
    monkeypatch.setenv("RINGLAB_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    line = one_error_line(ringlab("ls"))
    assert "cannot reach the ringlab service at http://127.0.0.1:9" in line


def test_token_is_sent_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    seeded = seed_sweeps(url)
    settings = Settings(database_url=url, api_token="s3cret")
    with live_server(make_web_app(settings)) as base:
        monkeypatch.setenv("RINGLAB_URL", base)
        monkeypatch.delenv("RINGLAB_API_TOKEN", raising=False)
        assert "401" in one_error_line(ringlab("cancel", str(seeded.benchmark)))
        monkeypatch.setenv("RINGLAB_API_TOKEN", "s3cret")
        result = ringlab("cancel", str(seeded.benchmark))
        assert result.exit_code == 0 and "0 runs cancelled" in result.stdout


def test_bundled_example_by_name() -> None:
    from service.cli.specs import load_specs

    (spec,) = load_specs("cpu-quick.yaml")
    assert spec["name"] == "cpu-quick"
    assert len(load_specs("max-seq-len-1gpu.yaml")) == 4  # three kernels, the naive baseline


@pytest.mark.ray
def test_cluster_lists_the_local_ray(
    base: str, ray_session: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ringlab cluster` against an API that reports the cluster at RINGLAB_RAY_ADDRESS (its
    Ray driver joins it: seconds, so the command is retried until it answers)."""
    address = ray_session.get_runtime_context().gcs_address
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}", ray_address=address)
    with live_server(make_web_app(settings)) as url:
        monkeypatch.setenv("RINGLAB_URL", url)
        deadline = time.monotonic() + 60
        while (result := ringlab("cluster")).exit_code != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
    assert result.exit_code == 0, result.stderr
    total = result.stdout.strip().splitlines()[-1]
    assert total.startswith("total: ") and "/8 CPUs free" in total and "/0 GPUs free" in total


def test_ls_and_show_fit_80_columns(base: str, service: tuple[str, Seeded]) -> None:
    """`ringlab ls` and `show` in an 80-column terminal: no line is longer; `ls` keeps each
    sweep on one line (a long name cut at its end), `show` cuts nothing."""
    exe = str(Path(sys.executable).parent / "ringlab")
    env = {**os.environ, "RINGLAB_URL": base, "COLUMNS": "80"}
    listed = subprocess.run([exe, "ls"], capture_output=True, text=True, env=env, timeout=60)
    shown = subprocess.run(
        [exe, "show", str(service[1].benchmark)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    for done in (listed, shown):
        assert done.returncode == 0, done.stderr
        assert max(len(line) for line in done.stdout.splitlines()) <= 80, done.stdout
    assert "…" not in shown.stdout, shown.stdout
    rows = listed.stdout.splitlines()
    first = next(i for i, line in enumerate(rows) if line.split()[:1] == ["1"])
    row = rows[first].split()
    assert row[0] == "1" and "17/17" in row  # the kind goes before a name is cut short
    assert "11-01 09:00" in rows[first]  # the creation minute, on the same line
    assert rows[first].rstrip().endswith("succeeded 17"), listed.stdout  # the state, whole
    assert " kernels on 2x" in rows[first] or "…" in rows[first]
    assert all(line.split()[0].isdigit() for line in rows[1:] if line.strip())  # no wrapping
    assert "progress 17/17: succeeded 17" in shown.stdout


def test_watch_shows_a_running_searchs_probes_as_they_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A max-length search's probes are stored while it runs (as the scheduler does) and
    `ringlab watch` prints each one when its event comes, before the sweep ends."""
    import threading
    import time

    from service import leases
    from service.db.engine import make_engine, make_sessionmaker
    from service.results import write

    url = f"sqlite:///{tmp_path / 'r.db'}"
    spec = {
        "name": "search", "kind": "max_seq_len",
        "base": {"kernel": "dense", "num_heads": 2, "head_dim": 16, "device": "cpu"},
        "search": {"start": 4096, "max": 16384, "granularity": 4096},
    }  # fmt: skip
    with live_server(make_web_app(Settings(database_url=url))) as base:
        monkeypatch.setenv("RINGLAB_URL", base)
        monkeypatch.setattr(console.err, "width", 200)
        sweep_id = httpx.post(f"{base}/api/v1/sweeps", json=spec).json()["id"]
        engine = make_engine(url)
        sm = make_sessionmaker(engine)

        def search() -> None:
            claim = leases.claim_next(sm, "test-scheduler", lease_s=60)
            assert claim is not None
            probes = [
                ProbeResult(seq_len=4096, outcome="fit", peak_memory_bytes=1 << 20),
                ProbeResult(seq_len=8192, outcome="oom", error="over budget"),
            ]
            for probe in probes:
                time.sleep(1.5)  # each is its own event
                assert write.record_probes(sm, claim, [probe])
            time.sleep(1.5)
            assert write.finish(
                sm, claim, write.Completion(leases.RunStatus.failed, "stopped", probes=probes)
            )

        worker = threading.Thread(target=search, daemon=True)
        worker.start()
        try:
            result = ringlab("watch", str(sweep_id))
        finally:
            worker.join(timeout=30)
            engine.dispose()
    assert "probe 1, 4,096 tokens fit" in result.stderr, result.stderr
    assert "probe 2, 8,192 tokens oom" in result.stderr, result.stderr
    assert result.stderr.index("probe 1") < result.stderr.index("probe 2")
