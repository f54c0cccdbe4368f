"""What a new user meets in the first hour, each command run as the user runs it (the installed
`ringlab` in a subprocess) against a live service (uvicorn on a free port, no scheduler: the
test moves runs through their states in the database, as the scheduler would): watching every
sweep of a file, resuming a cancelled sweep, a busy port, bundled examples by name, the
database serve and demo share, YAML errors with their place, and deleting a sweep."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _api_helpers import free_port
from _web_helpers import live_server, make_web_app
from sqlalchemy import update

from service.core.config import Settings
from service.db.engine import make_engine
from service.db.models import Run, RunStatus, utcnow

pytestmark = pytest.mark.timeout(120)
RINGLAB = str(Path(sys.executable).parent / "ringlab")
REPO = Path(__file__).resolve().parents[2]
TINY = (
    "name: tiny\nbase: {kernel: dense, device: cpu, num_heads: 2}\ngrid:\n  seq_len: [128, 256]\n"
)


def ringlab(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RINGLAB, *args],
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one `error: ...` line of a failed command (exit 1, nothing else on stderr)."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, database URL) of a live service on a fresh SQLite database."""
    url = f"sqlite:///{tmp_path_factory.mktemp('first-hour') / 'ringlab.db'}"
    with live_server(make_web_app(Settings(database_url=url))) as base:
        yield base, url


@pytest.fixture
def env(service: tuple[str, str], tmp_path: Path) -> dict[str, str]:
    """The environment of a user pointed at the service (no token; a private data dir)."""
    return {
        "RINGLAB_URL": service[0],
        "RINGLAB_API_TOKEN": "",
        "XDG_DATA_HOME": str(tmp_path / "data"),
    }


def set_status(
    database_url: str,
    sweep_ids: list[int],
    status: RunStatus,
    run_id: int | None = None,
    was: RunStatus | None = None,
) -> None:
    """Move the sweeps' runs (only `run_id`, only those in state `was`) to `status`, as the
    scheduler writes it."""
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            query = update(Run).where(Run.sweep_id.in_(sweep_ids))
            if run_id is not None:
                query = query.where(Run.id == run_id)
            if was is not None:
                query = query.where(Run.status == was)
            done = status not in (RunStatus.running, RunStatus.queued)
            values = {"status": status, "finished_at": utcnow() if done else None}
            if status == RunStatus.failed:
                values["error"] = "synthetic failure"
            conn.execute(query.values(**values))
    finally:
        engine.dispose()


def words(help_text: str) -> str:
    """--help output as one line of words (no box drawing, no wrapping)."""
    return " ".join(help_text.replace("│", " ").split())


def submitted_ids(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("sweep ")]


def start_watch(base: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], list[int]]:
    """`ringlab submit examples/cpu-max-seq-len-1gpu.yaml --watch` in a subprocess, and the
    ids of its four sweeps once the service holds them (within 30 s)."""
    proc = subprocess.Popen(
        [RINGLAB, "submit", "examples/cpu-max-seq-len-1gpu.yaml", "--watch"],
        env={**os.environ, **env},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    sweeps: list[dict] = []
    while len(sweeps) < 4 and time.monotonic() < deadline and proc.poll() is None:
        page = httpx.get(f"{base}/api/v1/sweeps", params={"name": "cpu max-seq-len 1"}).json()
        sweeps = sorted(page["data"], key=lambda s: s["id"])
        time.sleep(0.2)
    if len(sweeps) != 4:
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10))
    return proc, [s["id"] for s in sweeps]


def test_submit_watch_follows_every_sweep_of_the_file(
    service: tuple[str, str], env: dict[str, str]
) -> None:
    """The README's `ringlab submit examples/cpu-max-seq-len-1gpu.yaml --watch`: four sweeps,
    one progress line each, ended when all four are; a failed run makes the exit status 1."""
    base, database = service
    proc, ids = start_watch(base, {"COLUMNS": "200", **env})
    try:
        dense, sparse, dilated, naive = ids
        set_status(database, ids, RunStatus.running)
        time.sleep(1.5)  # the watcher sees them running
        failed_run = httpx.get(f"{base}/api/v1/sweeps/{sparse}/results.json").json()[0]["run_id"]
        set_status(database, [sparse], RunStatus.failed, run_id=failed_run)
        set_status(database, ids, RunStatus.succeeded, was=RunStatus.running)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, (stdout, stderr)
    assert submitted_ids(stdout)[:4] == ids
    assert f"sweep {dense} ended: succeeded 1" in stdout
    assert f"sweep {sparse} ended: succeeded 1, failed 1" in stdout
    assert f"sweep {dilated} ended: succeeded 1" in stdout
    assert f"sweep {naive} ended: succeeded 1" in stdout
    # the one progress display, final state: a line per sweep with done/total and the counts
    for sweep_id, name, total, failed in (
        (dense, "dense", 1, 0),
        (sparse, "block_sparse", 2, 1),
        (dilated, "dilated", 1, 0),
        (naive, "naive dense baseline (sdpa math)", 1, 0),
    ):
        (line,) = [ln for ln in stderr.splitlines() if f"sweep {sweep_id} " in ln]
        assert f"cpu max-seq-len 1 rank - {name}" in line, stderr
        assert f"{total}/{total}" in line and f"running 0, failed {failed}" in line, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"1 run failed or timed out: ringlab results {sparse}"
    )
    # every sweep succeeded: exit 0, one `ended` line each
    ok = ringlab("watch", str(dense), str(dilated), env=env)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()  # each search's answer below its sweep (none stored here)
    assert [ln for ln in lines if " ended: " in ln] == [
        f"sweep {dense} ended: succeeded 1",
        f"sweep {dilated} ended: succeeded 1",
    ]
    assert lines[1].startswith(f"sweep {dense} run ") and lines[1].endswith(": no length fit")


def test_retry_resumes_a_cancelled_sweep(service: tuple[str, str], env: dict[str, str]) -> None:
    """`ringlab cancel N; ringlab retry N` (the README) puts the cancelled runs back in the
    queue; --no-cancelled leaves them; --help says so."""
    base, _ = service
    sweep_id = httpx.post(f"{base}/api/v1/sweeps", json={"name": "resume", **_tiny()}).json()["id"]
    cancelled = f"sweep {sweep_id}: 2 runs cancelled\n"
    assert ringlab("cancel", str(sweep_id), env=env).stdout == cancelled
    done = ringlab("retry", str(sweep_id), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"sweep {sweep_id}: 2 runs requeued\n"
    counts = httpx.get(f"{base}/api/v1/sweeps/{sweep_id}").json()["counts"]
    assert counts["queued"] == 2 and counts["cancelled"] == 0
    assert ringlab("cancel", str(sweep_id), env=env).stdout == cancelled
    kept = ringlab("retry", str(sweep_id), "--no-cancelled", env=env)
    assert kept.stdout == f"sweep {sweep_id}: 0 runs requeued\n", kept.stderr
    assert "--no-cancelled leaves them cancelled" in words(ringlab("retry", "--help").stdout)


def _tiny() -> dict:
    return {
        "base": {"kernel": "dense", "device": "cpu", "num_heads": 2},
        "grid": {"seq_len": [128, 256]},
    }


@pytest.mark.parametrize(
    ("command", "how"),
    [("serve", "ringlab serve --port"), ("demo", "make run, or ringlab demo --port")],
)
def test_busy_port_is_one_line_before_anything_starts(
    command: str, how: str, tmp_path: Path
) -> None:
    """A port someone listens on: one line naming it and how to pick another, exit 1, in well
    under the ~10 s Ray takes to start, and no database touched."""
    database = tmp_path / "never.db"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = ringlab(
            command,
            "--port",
            str(port),
            env={"RINGLAB_DATABASE_URL": f"sqlite:///{database}", "XDG_DATA_HOME": str(tmp_path)},
        )
        elapsed = time.monotonic() - started
    line = error_line(done)
    assert line.startswith(f"error: port {port} on 127.0.0.1 is in use"), line
    assert how in line and "pick another" in line
    assert elapsed < 5, f"{elapsed:.1f} s"
    assert done.stdout == "" and "Ray" not in done.stderr
    assert not database.exists() and not (tmp_path / "ringlab").exists()


def test_serve_prints_its_database_and_dashboard_then_serves(tmp_path: Path) -> None:
    """With no RINGLAB_DATABASE_URL, serve says it uses ringlab.db in the user's data dir and
    where the dashboard is, and the dashboard answers there."""
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop("RINGLAB_DATABASE_URL", None)
    proc = subprocess.Popen(
        [RINGLAB, "serve", "--no-scheduler", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert first == f"dashboard: http://127.0.0.1:{port}/\n"
        assert second == f"database:  sqlite:///{tmp_path}/ringlab/ringlab.db\n"
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(first.split()[1], timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        assert page.status_code == 200 and "ringlab" in page.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert (tmp_path / "ringlab" / "ringlab.db").is_file()
    rule = "`ringlab serve` and `ringlab demo` use the same one"
    assert rule in words(ringlab("serve", "--help").stdout)


def test_demo_uses_the_database_serve_uses(tmp_path: Path) -> None:
    """The demo's default database is serve's (ringlab.db, not demo.db), and it says so before
    starting; here that file cannot be opened, so it stops there with one line."""
    (tmp_path / "ringlab" / "ringlab.db").mkdir(parents=True)  # a directory: sqlite cannot open it
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop("RINGLAB_DATABASE_URL", None)
    done = subprocess.run(
        [RINGLAB, "demo", "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.splitlines()[:2] == [
        f"dashboard: http://127.0.0.1:{port}/",
        f"database:  sqlite:///{tmp_path}/ringlab/ringlab.db",
    ]
    assert "cannot reach the database: unable to open database file" in error_line(done)
    rule = "`ringlab serve` and `ringlab demo` use the same one"
    assert rule in words(ringlab("demo", "--help").stdout)


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_database_password_is_masked(command: str, tmp_path: Path) -> None:
    """Both print RINGLAB_DATABASE_URL with its password hidden; an unreachable database is
    one line before uvicorn or Ray start."""
    url = "postgresql://ringlab:s3cret@127.0.0.1:1/ringlab"  # port 1: nothing listens
    port = free_port()
    env = {"RINGLAB_DATABASE_URL": url, "XDG_DATA_HOME": str(tmp_path)}
    done = ringlab(command, "--port", str(port), env=env)
    assert "database:  postgresql+psycopg://ringlab:***@127.0.0.1:1/ringlab" in done.stdout
    assert "cannot reach the database" in error_line(done)
    assert "s3cret" not in done.stdout + done.stderr


def test_bundled_examples_by_name(env: dict[str, str], tmp_path: Path) -> None:
    """Outside a checkout: `cpu-quick`, `cpu-quick.yaml` and `examples/cpu-quick.yaml` are the
    bundled example; a wrong name lists them all and suggests the closest."""
    for name in ("cpu-quick", "cpu-quick.yaml", "examples/cpu-quick.yaml"):
        done = ringlab("submit", name, "--idempotency-key", "quick", env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0].endswith("(cpu-quick): 9 runs")
    line = error_line(ringlab("submit", "cpu-quik", env=env, cwd=tmp_path))
    assert line.startswith("error: cpu-quik: no such file, nor a bundled example")
    assert "did you mean cpu-quick?" in line
    assert (
        "bundled examples: compare-flex, compare-rings, cpu-compare-flex, " in line
        and "training-memory-80gb" in line
    )


def test_yaml_syntax_error_says_where(env: dict[str, str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nbase: {kernel: dense, seq_len: 64\ngrid:\n  seq_len: [128]\n")
    done = ringlab("submit", str(broken), env=env)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"error: {broken}:3:5: not valid YAML: expected ',' or '}}', but got ':' "
        "(while parsing a flow mapping at line 2, column 7)",
        "  2 | base: {kernel: dense, seq_len: 64",
    ]


def test_delete_asks_and_refuses_while_running(
    service: tuple[str, str], env: dict[str, str], tmp_path: Path
) -> None:
    base, database = service
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    sweep_id = submitted_ids(ringlab("submit", str(spec), env=env).stdout)[0]
    no = ringlab("delete", str(sweep_id), env=env, stdin="n\n")
    assert no.returncode == 1 and no.stdout == ""  # the question goes to stderr
    assert no.stderr == (
        f"Delete sweep {sweep_id} (tiny, 2 runs) and its results? [y/N] \n"
        f"error: sweep {sweep_id} not deleted; answer y, or pass --yes\n"
    )
    set_status(database, [sweep_id], RunStatus.running)
    line = error_line(ringlab("delete", str(sweep_id), "--yes", env=env))
    assert line == (
        f"error: sweep {sweep_id} has running or waiting runs; cancel it first: "
        f"ringlab cancel {sweep_id}"
    )
    assert ringlab("cancel", str(sweep_id), env=env).returncode == 0
    yes = ringlab("delete", str(sweep_id), env=env, stdin="y\n")
    assert yes.returncode == 0, yes.stderr
    assert yes.stdout == f"deleted sweep {sweep_id} (tiny, 2 runs)\n"
    assert httpx.get(f"{base}/api/v1/sweeps/{sweep_id}").status_code == 404
    assert "404" in error_line(ringlab("delete", str(sweep_id), "--yes", env=env))


def test_the_port_is_held_from_the_check_until_uvicorn_serves_on_it(tmp_path: Path) -> None:
    """check_port returns the bound, listening sockets: nobody can take the port while Ray
    starts, and the server then serves on those very sockets."""
    import errno
    import threading

    import uvicorn

    from service.app import create_app
    from service.cli.ports import check_port

    port = free_port()
    sockets = check_port("127.0.0.1", port, "pick another")
    with socket.socket() as late:
        late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as taken:
            late.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
    config = uvicorn.Config(
        create_app(Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}")), host="127.0.0.1",
        port=port,
        log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz").status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)
