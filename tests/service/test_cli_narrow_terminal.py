"""The CLI as a researcher reads it in an 80-column terminal (issue 40), each command the
installed `ringlab` in a subprocess at COLUMNS=80 against a live service (no scheduler: the
test stores what the scheduler would): a watch names every sweep distinctly and ends with each
search's answer, counts read "1 run", and `ls` keeps each sweep on one line."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
from sqlalchemy.orm import Session
from test_cli_first_commands import REPO, RINGLAB, env, ringlab, service, set_status, start_watch  # noqa: F401

from service.db.engine import make_engine
from service.db.models import Probe, ProbeOutcome, RankResultRow, Run, RunStatus, utcnow

COLUMNS = {"COLUMNS": "80"}


def finish_search(database_url: str, run_id: int, answer: int, took_s: float) -> None:
    """Store a finished search of `took_s` seconds that fit `answer` tokens (and no more)."""
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            run = session.get(Run, run_id)
            assert run is not None
            end = utcnow()
            run.status, run.started_at, run.finished_at = (
                RunStatus.succeeded, end - timedelta(seconds=took_s), end
            )  # fmt: skip
            session.add(
                RankResultRow(run_id=run_id, rank=0, seq_len=answer, times_s=[0.02], median_s=0.02,
                           p10_s=0.02, p90_s=0.02, tokens_per_s=answer / 0.02, flops=1e9,
                           flops_per_s=5e10, peak_memory_bytes=1 << 24, backend="sdpa-flash-cpu")
            )  # fmt: skip
            session.add(Probe(run_id=run_id, seq_len=answer, outcome=ProbeOutcome.fit, time_s=0.02))
            session.add(Probe(run_id=run_id, seq_len=answer + 1024, outcome=ProbeOutcome.oom))
            session.commit()
    finally:
        engine.dispose()


def test_watch_at_80_columns_names_each_sweep_and_prints_each_answer(
    service: tuple[str, str],  # noqa: F811
    env: dict[str, str],  # noqa: F811
) -> None:
    base, database = service
    proc, ids = start_watch(base, {**COLUMNS, **env})
    try:
        set_status(database, ids, RunStatus.waiting_resources)
        time.sleep(1.0)  # the watcher sees them waiting: the longest counts line
        runs = {
            i: httpx.get(f"{base}/api/v1/runs", params={"sweep_id": i}).json()["data"] for i in ids
        }
        for n, i in enumerate(ids):
            for m, r in enumerate(runs[i]):
                finish_search(database, r["id"], 31744 - 1024 * (n + m), 46 + n)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, (stdout, stderr)
    assert "(cpu max-seq-len 1 rank - dense): 1 run\n" in stdout, stdout
    assert "1 runs" not in stdout + stderr
    # a progress line per sweep, each named by what differs, none over 80 columns
    for sweep_id, name in zip(ids, ("dense", "block_sparse", "dilated", "naive"), strict=True):
        (line,) = [ln for ln in stderr.splitlines() if ln.startswith(f"sweep {sweep_id} ")]
        assert f"sweep {sweep_id} …{name}" in line, stderr
    assert max(len(ln) for ln in stderr.splitlines()) <= 80, stderr
    # each search's answer when its sweep ends, with how long it took
    first = runs[ids[0]][0]["id"]
    assert f"sweep {ids[0]} ended: succeeded 1\nsweep {ids[0]} run {first} dense: " in stdout
    assert f"run {first} dense: max 31,744 tokens (the search took 46 s)\n" in stdout, stdout
    answers = [ln for ln in stdout.splitlines() if ": max " in ln]
    assert len(answers) == sum(len(r) for r in runs.values()), stdout


def test_ls_at_80_columns_keeps_each_sweep_on_one_line(
    service: tuple[str, str],  # noqa: F811
    env: dict[str, str],  # noqa: F811
) -> None:
    base, database = service
    spec = {
        "name": "a sweep whose name is much too long for an eighty column terminal, as they are",
        "base": {"kernel": "dense", "device": "cpu", "num_heads": 2},
        "grid": {"seq_len": [128, 256, 384]},
    }
    alike = [f"cpu max-seq-len 1 rank - {k}" for k in ("dense", "block_sparse", "dilated")]
    alike_ids = [httpx.post(f"{base}/api/v1/sweeps", json={**spec, "name": n}).json()["id"]
                 for n in alike]  # fmt: skip
    sweep_id = httpx.post(f"{base}/api/v1/sweeps", json=spec).json()["id"]
    run_ids = [r["id"] for r in httpx.get(f"{base}/api/v1/runs", params={"sweep_id": sweep_id})
               .json()["data"]]  # fmt: skip
    set_status(database, [sweep_id], RunStatus.waiting_resources, run_id=run_ids[0])
    set_status(database, [sweep_id], RunStatus.failed, run_id=run_ids[1])
    done = ringlab("ls", env={**env, **COLUMNS})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (row,) = [ln for ln in lines if ln.lstrip().startswith(f"{sweep_id} ")] or [done.stdout]
    assert row.rstrip().endswith("  1/3  queued 1, waiting 1, failed 1"), done.stdout
    assert "  a sweep w" in row and "…" in row
    assert all(len(ln) <= 80 for ln in lines), done.stdout
    # names cut alike at their end ("cpu max…") keep what tells them apart: their tails
    cells = [next(ln for ln in lines if ln.lstrip().startswith(f"{i} ")).lstrip()
             .removeprefix(f"{i} ").strip().split("  ")[0] for i in alike_ids]  # fmt: skip
    assert len(set(cells)) == 3 and all("…" in c for c in cells), done.stdout
    # and stay readable: the whole word that tells them apart, not its last letters
    assert [c.split()[-1] for c in cells] == ["dense", "block_sparse", "dilated"], done.stdout
    assert "kind" not in lines[0]  # the column `show` has went first, so names stay readable
    # the counted nouns: one run, one sweep's delete prompt
    cancelled = ringlab("cancel", str(sweep_id), env=env)
    assert cancelled.stdout.strip() == f"sweep {sweep_id}: 2 runs cancelled", cancelled.stdout
    retried = ringlab("retry", str(sweep_id), "--no-cancelled", env=env)
    assert retried.stdout.strip() == f"sweep {sweep_id}: 1 run requeued", retried.stdout
