"""A 100,000-cell sweep POST against a live server on Postgres, while 50 event streams are open.

Starts `run_server` (no scheduler) in its own process on a fresh Postgres schema, opens --streams
event streams on a small sweep, then POSTs --posts sweeps of --cells cells (100 lengths x
cells/100 batch sizes) one after another. For each POST it prints the time at the client, the
server's peak resident memory above its resident memory just before (Linux: VmHWM after
resetting it through /proc/PID/clear_refs), and /healthz latency polled every 50 ms meanwhile.

    RINGLAB_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python bench/big_sweep.py [--posts 3] [--cells 100000] [--streams 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "bench_service", Path(__file__).with_name("service.py")
)
assert _spec is not None and _spec.loader is not None
bench_service: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_service)

API = "/api/v1"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--posts", type=int, default=3, help="big sweeps POSTed, one at a time")
    ap.add_argument("--cells", type=int, default=100_000, help="cells per sweep (multiple of 100)")
    ap.add_argument("--streams", type=int, default=50, help="event streams held open meanwhile")
    ap.add_argument(
        "--database-url",
        default=os.environ.get("RINGLAB_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1/test"),
    )
    return ap.parse_args()


def big_spec(n: int, cells: int) -> dict[str, Any]:
    return {
        "name": f"bench-big-{n}",
        "base": {"kernel": "dense", "num_heads": 8, "head_dim": 64},
        "grid": {
            "seq_len": [1024 * (i + 1) for i in range(100)],
            "batch_size": list(range(1, cells // 100 + 1)),
        },
    }


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def hold_streams(base: str, sweep_id: int, n: int, stop: threading.Event) -> None:
    """n event streams on the sweep, read until `stop`."""
    opened = threading.Semaphore(0)

    def reader() -> None:
        url = f"{base}{API}/sweeps/{sweep_id}/events"
        try:
            with httpx.stream("GET", url, timeout=600) as r:
                r.raise_for_status()
                opened.release()
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return
        except httpx.TransportError:
            if not stop.is_set():  # the server closing at the end is expected
                raise

    for _ in range(n):
        threading.Thread(target=reader, daemon=True).start()
    for _ in range(n):
        if not opened.acquire(timeout=60):
            raise SystemExit("an event stream did not open")


def poll_health(base: str, done: threading.Event, health: list[float]) -> None:
    """GET /healthz every 50 ms until `done`, appending each request's time to `health`."""
    with httpx.Client(base_url=base, timeout=30) as h:
        while not done.is_set():
            t0 = time.perf_counter()
            h.get(f"{API}/healthz").raise_for_status()
            health.append(time.perf_counter() - t0)
            time.sleep(0.05)


def reads(http: httpx.Client, pid: int, sweep_id: int) -> None:
    """Time and server peak memory of the reads of one big sweep: its detail, the sweep page's
    data (the first read finds the sweep's context; later ones reuse it), a later page, the
    rows of changed runs, one run's page, and the whole streamed exports."""
    first_run = http.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()
    rid = first_run["data"][0]["id"]
    changed = ",".join(str(rid + i) for i in range(0, 20_000, 100))  # 200 runs an event named
    paths = [
        f"{API}/sweeps/{sweep_id}",
        f"/sweeps/{sweep_id}/dashboard.json",
        f"/sweeps/{sweep_id}/dashboard.json",
        f"/sweeps/{sweep_id}/dashboard.json?after={rid + 50_000}",
        f"/sweeps/{sweep_id}/dashboard.json?runs={changed}",
        f"/runs/{rid + 777}",
        f"/sweeps/{sweep_id}",
        f"{API}/sweeps/{sweep_id}/results.json",
        f"{API}/sweeps/{sweep_id}/results.csv",
    ]
    for path in paths:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        rss0 = kib(pid, "VmRSS")
        t0 = time.perf_counter()
        r = http.get(path)
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        peak = (kib(pid, "VmHWM") - rss0) / 1024
        print(
            f"GET {path[:70]}{'...' if len(path) > 70 else ''}: {elapsed:.2f} s, "
            f"{len(r.content) / 1e6:.1f} MB, server peak +{peak:.0f} MiB"
        )


def main() -> None:
    args = parse()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"setup: {os.cpu_count()} CPUs (load average {load}), Postgres at")
    print(f"       {args.database_url.split('@')[-1]}, run_server (uvicorn, 1 worker, no")
    print(f"       scheduler) in its own process; {args.streams} event streams open; client times")
    with (
        bench_service.fresh_schema(args.database_url) as url,
        bench_service.serve_subprocess(url) as base,
        httpx.Client(base_url=base, timeout=600) as http,
    ):
        if True:
            pid = bench_service.SERVER_PIDS[base]
            small = {"name": "watched", "base": {"kernel": "dense"}, "grid": {"seq_len": [64]}}
            watched = http.post(f"{API}/sweeps", json=small).json()["id"]
            stop = threading.Event()
            hold_streams(base, watched, args.streams, stop)
            for n in range(args.posts):
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
                rss0 = kib(pid, "VmRSS")
                health: list[float] = []
                done = threading.Event()

                poller = threading.Thread(
                    target=poll_health, args=(base, done, health), daemon=True
                )
                poller.start()
                t0 = time.perf_counter()
                r = http.post(f"{API}/sweeps", json=big_spec(n, args.cells))
                post_s = time.perf_counter() - t0
                done.set()
                poller.join()
                if r.status_code != 201 or r.json()["total"] != args.cells:
                    raise SystemExit(f"POST failed: {r.status_code} {r.text[:300]}")
                peak = kib(pid, "VmHWM") - rss0
                print(
                    f"POST {args.cells:,} cells #{n + 1}: {post_s:.2f} s (target <= 5 s); server "
                    f"peak +{peak / 1024:.0f} MiB over {rss0 / 1024:.0f} MiB (target < 200 MiB); "
                    f"/healthz during it: {len(health)} requests, p50 "
                    f"{statistics.median(health) * 1e3:.1f} ms, p95 "
                    f"{bench_service.pct(health, 0.95) * 1e3:.1f} ms, max "
                    f"{max(health) * 1e3:.1f} ms (target p95 <= 50 ms)"
                )
            reads(http, pid, sweep_id=watched + 1)
            stop.set()
            time.sleep(1.5)  # readers see `stop` at their next ping, before the server goes


if __name__ == "__main__":
    main()
