"""The reads of one finished 100,000-run sweep against a live server on Postgres: report.md,
compare, results.csv and .json, the sweep page and its data, with the server's memory.

Starts `run_server` (no scheduler) in its own process on a fresh Postgres schema, POSTs one
sweep of --cells cells, marks every run succeeded with one rank's result (bulk SQL: what a
scheduler would have written), then GETs each read once. For each it prints the time at the
client, the server's peak resident memory above its resident memory just before (Linux: VmHWM
after resetting it through /proc/PID/clear_refs) and its resident memory 2 s after the answer
against before it.

    RINGLAB_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python bench/big_report.py [--cells 100000] [--only report --only compare]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402
from sqlalchemy import insert, select, update  # noqa: E402


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPO = Path(__file__).resolve().parent.parent
# The server runs from / (bench_service.serve_subprocess): without this, it would import
# whichever checkout the environment installed, not the tree this file is in.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
)
bench_service = _load("service.py")
big_sweep = _load("big_sweep.py")
API = "/api/v1"


READS = ("page", "dashboard", "json", "csv", "report", "compare", "compare-page")
"""The reads measured, by name (--only), in the order they run."""


def paths(sweep: int) -> dict[str, str]:
    """Each read's path for the sweep, by its name in READS."""
    return {
        "page": f"/sweeps/{sweep}",
        "dashboard": f"/sweeps/{sweep}/dashboard.json",
        "json": f"{API}/sweeps/{sweep}/results.json",
        "csv": f"{API}/sweeps/{sweep}/results.csv",
        "report": f"{API}/sweeps/{sweep}/report.md",
        "compare": f"{API}/sweeps/{sweep}/compare/{sweep}",
        "compare-page": f"/compare?a={sweep}&b={sweep}",
    }


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=100_000, help="runs of the sweep (x100)")
    ap.add_argument(
        "--only",
        action="append",
        choices=READS,
        help="measure only this read (repeatable; default: every one, in this order: "
        + ", ".join(READS)
        + ")",
    )
    ap.add_argument(
        "--database-url",
        default=os.environ.get("RINGLAB_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1/test"),
    )
    return ap.parse_args()


def finish_every_run(url: str, sweep_id: int) -> None:
    """Every run of the sweep succeeded, with one rank's result and one environment."""
    from service.db.engine import (
        make_engine,
        make_sessionmaker,
    )  # after sys.path is set to this tree
    from service.db.models import (
        Environment,
        RankResultRow,
        Run,
        RunStatus,
        utcnow,
    )  # after sys.path is set to this tree

    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        env = Environment(hash="b" * 64, hosts=["node"], gpus=[], torch="2", python="3.11")
        session.add(env)
        session.flush()
        now = utcnow()
        session.execute(
            update(Run)
            .where(Run.sweep_id == sweep_id)
            .values(
                status=RunStatus.succeeded, environment_id=env.id, started_at=now, finished_at=now
            )
        )
        runs = session.execute(select(Run.id, Run.seq_len).where(Run.sweep_id == sweep_id)).all()
        for start in range(0, len(runs), 10_000):
            rows = []
            for i, (run_id, seq_len) in enumerate(runs[start : start + 10_000]):
                median = 1e-3 * (1 + (start + i) % 97 / 100)
                rows.append({
                    "run_id": run_id, "rank": 0, "seq_len": seq_len,
                    "times_s": [median * 0.9, median, median * 1.1], "median_s": median,
                    "p10_s": median * 0.9, "p90_s": median * 1.1,
                    "tokens_per_s": seq_len / median, "flops": 1e9, "flops_per_s": 1e9 / median,
                    "peak_memory_bytes": seq_len * 1024, "backend": "torch",
                })  # fmt: skip
            session.execute(insert(RankResultRow), rows)
        session.commit()
    engine.dispose()


def measure(http: httpx.Client, pid: int, path: str) -> None:
    """GET `path` once: client time, size, server peak above before, resident after."""
    kib = big_sweep.kib
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0 = kib(pid, "VmRSS")
    t0 = time.perf_counter()
    r = http.get(path)
    elapsed = time.perf_counter() - t0
    peak = (kib(pid, "VmHWM") - rss0) / 1024
    time.sleep(2)
    after = (kib(pid, "VmRSS") - rss0) / 1024
    print(
        f"GET {path}: {r.status_code}, {elapsed:.2f} s, {len(r.content) / 1e6:.1f} MB; server "
        f"peak +{peak:.0f} MiB over {rss0 / 1024:.0f} MiB, 2 s later {after:+.0f} MiB",
        flush=True,
    )


def main() -> None:
    args = parse()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"setup: {os.cpu_count()} CPUs (load average {load}); one sweep of {args.cells:,} runs")
    with (
        bench_service.fresh_schema(args.database_url) as url,
        bench_service.serve_subprocess(url) as base,
        httpx.Client(base_url=base, timeout=900) as http,
    ):
        pid = bench_service.SERVER_PIDS[base]
        t0 = time.perf_counter()
        sweep = http.post(f"{API}/sweeps", json=big_sweep.big_spec(0, args.cells)).json()["id"]
        finish_every_run(url, sweep)
        print(f"seeded in {time.perf_counter() - t0:.0f} s", flush=True)
        chosen = paths(sweep)
        for name in READS:
            if args.only is None or name in args.only:
                measure(http, pid, chosen[name])


if __name__ == "__main__":
    main()
