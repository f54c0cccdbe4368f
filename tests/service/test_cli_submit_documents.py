"""`ringlab submit FILE` with several documents, as a user runs it against a live service:
all sweeps stored or none (every document's problems printed), `--dry-run` prints each
document's cells and problems and stores nothing, `--watch` follows every sweep it made."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _web_helpers import live_server, make_web_app

from service.core.config import Settings

pytestmark = pytest.mark.timeout(180)

GOOD = """\
name: first
base: {kernel: dense, device: cpu, num_heads: 2, head_dim: 16}
grid:
  seq_len: [128, 256]
---
name: second
base: {kernel: dense, device: cpu, num_heads: 2, head_dim: 16}
grid:
  seq_len: [128, 256, 512]
"""
BAD = GOOD.replace("[128, 256, 512]", "[128, long]") + (
    "---\nname: third\nbase: {kernel: dense, seq_len: 64}\ngrid: {bogus: [1]}\n"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('submit') / 'ringlab.db'}"
    with live_server(make_web_app(Settings(database_url=url))) as served:
        yield served


def ringlab(base: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "ringlab")
    env = {**os.environ, "RINGLAB_URL": base, "COLUMNS": "120"}
    env.pop("RINGLAB_API_TOKEN", None)
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=120)


def sweep_names(base: str) -> list[str]:
    return [s["name"] for s in httpx.get(f"{base}/api/v1/sweeps").json()["data"]]


def test_a_file_lands_whole_or_not_at_all(base: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    before = sweep_names(base)
    done = ringlab(base, "submit", str(bad))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0] == (
        f"error: {bad}: nothing submitted: 2 problems in its 3 documents; fix them and submit again"
    )
    assert lines[1].startswith("  documents[1].grid.seq_len[1]: Input should be a valid integer")
    assert lines[2].startswith("  documents[2].grid.bogus: unknown axis 'bogus'")
    assert sweep_names(base) == before  # the valid first document was not stored

    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    done = ringlab(base, "submit", str(good), "--print-id")
    assert done.returncode == 0, done.stderr
    ids = [int(line) for line in done.stdout.split()]
    totals = [httpx.get(f"{base}/api/v1/sweeps/{i}").json()["total"] for i in ids]
    assert totals == [2, 3]


def test_dry_run_prints_each_documents_cells_and_problems(base: str, tmp_path: Path) -> None:
    before = sweep_names(base)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    done = ringlab(base, "submit", "--dry-run", str(bad))
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "documents[0] (first): 2 cells, ok",
        "documents[1] (second): 2 cells, 1 problem",
        "  documents[1].grid.seq_len[1]: Input should be a valid integer (cell seq_len='long')",
        "documents[2] (third): 1 cell, 1 problem",
        done.stdout.splitlines()[4],
        f"{bad}: dry run, nothing stored",
    ]
    assert done.stdout.splitlines()[4].startswith("  documents[2].grid.bogus: unknown axis")
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    done = ringlab(base, "submit", "--dry-run", str(good))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [
        "documents[0] (first): 2 cells, ok",
        "documents[1] (second): 3 cells, ok",
    ]
    assert sweep_names(base) == before


def test_watch_follows_every_sweep_of_the_file(base: str, tmp_path: Path) -> None:
    """No scheduler runs them: each sweep is cancelled once it is stored, and the watch ends
    with a line for each."""
    good = tmp_path / "watched.yaml"
    good.write_text(GOOD.replace("first", "w-first").replace("second", "w-second"))
    stop = threading.Event()

    def cancel_new() -> None:
        while not stop.wait(0.3):
            for s in httpx.get(f"{base}/api/v1/sweeps").json()["data"]:
                if s["name"].startswith("w-") and not s["done"]:
                    httpx.post(f"{base}/api/v1/sweeps/{s['id']}/cancel")

    canceller = threading.Thread(target=cancel_new, daemon=True)
    canceller.start()
    try:
        done = ringlab(base, "submit", str(good), "--watch")
    finally:
        stop.set()
        canceller.join()
    assert done.returncode == 0, done.stderr
    ids = [int(line.split()[1]) for line in done.stdout.splitlines() if "runs" in line]
    assert len(ids) == 2
    assert f"sweep {ids[0]} ended: cancelled 2" in done.stdout
    assert f"sweep {ids[1]} ended: cancelled 3" in done.stdout
