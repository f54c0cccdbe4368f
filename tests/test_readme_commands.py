"""Every command of the README's Quick start and CLI blocks, run as written against a live
`make run` (the demo: service, scheduler and dashboard on a local Ray of its own): the demo's
own sweep finishes with every run succeeded, and the demo shuts down cleanly on Ctrl-C.

`make test` is the one command not run here: it is the command running this test.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from _api_helpers import finished_sweep, free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def bash_block(section: str) -> str:
    """The first ```bash block under the README heading `section`."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block is not None, f"no bash block under {section}"
    return block.group(1)


def test_quick_start_block_is_make_run_and_make_test() -> None:
    commands = [line.split("#")[0].strip() for line in bash_block("Quick start").splitlines()]
    assert commands == ["make run", "make test"]


def _read_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> tuple[str, str]:
    """The first output line starting with `prefix`, and everything seen up to it."""
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen += line
        if line.startswith(prefix):
            return line, seen
    raise AssertionError(f"no {prefix!r} line from make run (exit {proc.poll()}):\n{seen}")


@pytest.mark.ray_process
@pytest.mark.timeout(720)
def test_readme_commands_run_as_written(tmp_path: Path) -> None:
    """`make run`, then the CLI block line by line in one shell, from a folder holding the
    repository's .venv and examples (so report.md lands there, not in the checkout)."""
    port = free_port()
    env = {
        **os.environ,
        "PORT": str(port),
        "RINGLAB_DATABASE_URL": f"sqlite:///{tmp_path / 'ringlab.db'}",
        "RINGLAB_URL": f"http://127.0.0.1:{port}",
        "XDG_DATA_HOME": str(tmp_path / "data"),
    }
    demo = subprocess.Popen(
        ["make", "run"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    drained: list[str] = []  # the demo's output after the Dashboard line, read as it comes
    try:
        line, seen = _read_line(demo, "Dashboard: ", timeout=180)
        assert demo.stdout is not None  # a full pipe would block the service's logging
        drain = threading.Thread(target=lambda: drained.extend(demo.stdout), daemon=True)
        drain.start()
        dashboard = line.removeprefix("Dashboard: ").strip()
        assert dashboard == f"http://127.0.0.1:{port}/sweeps/1", seen
        # start-up prints ringlab's lines and real problems only (no NumPy, Ray SIGTERM or
        # token-auth notices)
        noise = [x for x in seen.splitlines() if re.search(r"warn|traceback", x, re.I)]
        assert noise == [], seen
        assert "database:" in seen and f"http://127.0.0.1:{port}" in seen, seen
        assert httpx.get(dashboard, timeout=10).status_code == 200

        work = tmp_path / "work"
        work.mkdir()
        (work / ".venv").symlink_to(ROOT / ".venv")
        (work / "examples").symlink_to(ROOT / "examples")
        block = bash_block("Dashboard and CLI")
        run = subprocess.run(
            ["bash", "-e", "-c", block],
            cwd=work,
            env={**env, "COLUMNS": "100"},
            capture_output=True,
            text=True,
            timeout=540,  # under 2-core CI load the 4 searches alone took 400+ s once
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out
        # submit --watch: the file's four sweeps, each followed to its end
        assert re.search(r"sweep 2 \(cpu max-seq-len 1 rank - dense\)", out), out
        assert len(re.findall(r"sweep [2345] ended", out)) == 4, out
        # the bundled example by name, its id from --print-id: the sixth sweep, shown
        assert "sweep 6 cpu-quick (benchmark)" in out, out
        # results as CSV: a header and the sweep's nine runs, whatever they have done yet
        header = next(x for x in out.splitlines() if x.startswith("run_id,"))
        rows = list(csv.DictReader(io.StringIO("\n".join([header, *_csv_lines(out, header)]))))
        assert {r["sweep_id"] for r in rows} == {"6"} and len(rows) == 9, rows
        # cancel stops a sweep still running (behind the demo's), retry resumes it
        cancelled = re.findall(r"sweep 6: (\d+) runs? cancelled", out)
        assert len(cancelled) == 2 and int(cancelled[0]) > 0, out
        assert re.search(r"sweep 6: [1-9]\d* runs? requeued", out), out
        # under one memory budget the sparse kernels reach at least dense's length (issue 16)
        base = env["RINGLAB_URL"]
        sparse = httpx.get(f"{base}/api/v1/sweeps/3/results.json", timeout=10).json()
        rows = [{"max_seq_len": r["max_seq_len"]} for r in sparse]
        dense, dilated = (
            httpx.get(f"{base}/api/v1/sweeps/{n}/results.json", timeout=10).json() for n in (2, 4)
        )
        longest = dense[0]["max_seq_len"]
        reached = [int(r["max_seq_len"] or 0) for r in rows] + [dilated[0]["max_seq_len"] or 0]
        assert longest and all(n >= longest for n in reached), (longest, reached)
        # the naive baseline (sdpa math, its O(n^2) scores) stops far below: the seeds' gap
        (naive,) = httpx.get(f"{base}/api/v1/sweeps/5/results.json", timeout=10).json()
        assert naive["kernel"] == "sdpa" and 0 < naive["max_seq_len"] <= longest // 4, naive
        report = (work / "report.md").read_text()
        assert report.startswith("# cpu-quick\n\nSweep 6 ")
        # delete $id --yes: gone; the others stay
        assert httpx.get(f"{base}/api/v1/sweeps/6", timeout=10).status_code == 404
        assert httpx.get(f"{base}/api/v1/sweeps/3", timeout=10).status_code == 200
        # the demo's own sweep (examples/cpu-quick.yaml) finished on the CPU, every run fine
        demo_sweep = finished_sweep(f"{base}/api/v1/sweeps/1", timeout=120)
        assert demo_sweep["counts"]["succeeded"] == demo_sweep["total"] == 9, demo_sweep
        assert "cpu-quick" in httpx.get(dashboard, timeout=10).text
        # the demo says when its sweep ended, where to look, and three rows of what it found;
        # uvicorn's access lines went to the file it named, not to the terminal
        ending = re.compile(r"demo sweep 1 ended \(succeeded 9\): (\S+)\n((?:  .*\n){3})")
        deadline = time.monotonic() + 30  # the line and its three rows may arrive apart
        while not ending.search("".join(drained)) and time.monotonic() < deadline:
            time.sleep(0.2)
        told = "".join(drained)
        ended = ending.search(told)
        assert ended and ended.group(1) == dashboard, told
        assert all(" at 2,048: " in row for row in ended.group(2).splitlines()), told
        assert '"GET /' not in seen + told, told
        access = tmp_path / "data" / "ringlab" / "demo-access.log"
        assert f"access log: {access}" in seen and '"GET /sweeps/1 HTTP/1.1" 200' in (
            access.read_text()
        ), seen
        # Ctrl-C (what the demo says stops it): SIGINT to the terminal's whole group, make
        # included; the service shuts down through its lifespan
        os.killpg(demo.pid, signal.SIGINT)
        demo.wait(timeout=60)
        drain.join(timeout=10)
        rest = "".join(drained)
        assert "Application shutdown complete" in rest, rest
        assert not re.search(r"traceback", rest, re.I), rest
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()


def _csv_lines(out: str, header: str) -> list[str]:
    """The CSV rows printed right after `header` (up to the first line that is not one)."""
    lines = out.splitlines()
    at = lines.index(header)
    rows = []
    for line in lines[at + 1 :]:
        if not re.match(r"\d+,", line):
            break
        rows.append(line)
    return rows
