"""REST API latency against a live service on Postgres: a 10,000-cell POST and filtered run pages.

Starts uvicorn in-process on a free port, on a fresh Postgres schema (dropped at the end), then
1. POSTs --posts sweeps of 100 x 100 = 10,000 cells each (dense, seq_len x batch_size axes),
   timing each request at the client (validation, expansion, bulk insert, commit, response);
2. bulk-inserts runs directly until the run table holds --runs rows (mixed kernels, states,
   world sizes, dtypes), VACUUM ANALYZEs it, and for each of FILTERS walks up to --depth pages of
   --limit runs by following each page's `next` cursor, timing every request;
3. reads --offsets pages by `skip` per filter in each of OFFSET_BANDS, with the count and with
   count=false, each followed at once by the page at the same depth by a cursor kept from 2.

    RINGLAB_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python bench/service.py [--posts 5] [--runs 100000] [--depth 200] [--limit 50]
        [--separate-process]

With --post-only it times POSTs alone: --posts sweeps each of 1,000, 10,000 and 100,000 cells
(--sizes), the median of each beside the others from the same run (targets: 10,000 cells
<= 0.8 s, 100,000 <= 3 s).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Run as `python bench/service.py`, this directory comes first on sys.path and this file's name
# would shadow the `service` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from sqlalchemy import func, insert, select, text  # noqa: E402

from service.app import create_app  # noqa: E402
from service.core.config import Settings, normalize_database_url  # noqa: E402
from service.db.engine import make_engine, make_sessionmaker, scratch_schema  # noqa: E402
from service.db.models import Run, RunStatus, Sweep, SweepKind, utcnow  # noqa: E402
from service.spec import SweepSpec, canonical_json, cell_key_of, expand, iter_cells  # noqa: E402
from workers.config import RunConfig  # noqa: E402

API = "/api/v1"
FILTERS: list[dict[str, Any]] = [
    {},
    {"kernel": "dense", "status": "queued", "world_size": 1},
    {"kernel": "dense", "status": "succeeded", "world_size": 2, "sort": "-seq_len"},
    {"kernel": "dense"},
    {"status": "failed", "sort": "-seq_len"},
    {"seq_len_min": 4096, "seq_len_max": 65536, "dtype": "bfloat16", "sort": "seq_len"},
    {"sweep_id": 1},
    {"sweep_id": "first filled", "status": "succeeded"},
]
"""The filters a researcher uses: one sweep's runs (a POSTed one, all queued, and the first
filled one, mixed states), a kernel, a state, a length range; each page walk follows `next` as
far as --depth pages."""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--posts", type=int, default=5, help="10,000-cell sweeps POSTed")
    ap.add_argument("--runs", type=int, default=100_000, help="runs in the table for the GETs")
    ap.add_argument("--depth", type=int, default=200, help="pages walked per filter by cursor")
    ap.add_argument("--limit", type=int, default=50, help="runs per page")
    ap.add_argument(
        "--offsets", type=int, default=40, help="pages read by skip= per filter and depth band"
    )
    ap.add_argument(
        "--database-url",
        default=os.environ.get("RINGLAB_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1/test"),
    )
    ap.add_argument(
        "--post-only",
        action="store_true",
        help="time only POSTs: --posts each of 1,000, 10,000 and 100,000 cells (--sizes), "
        "then stop (no run pages)",
    )
    ap.add_argument(
        "--sizes",
        default="1000,10000,100000",
        help="cells per POSTed sweep with --post-only, comma-separated (multiples of 100)",
    )
    ap.add_argument(
        "--separate-process",
        action="store_true",
        help="serve from a subprocess (run_server) instead of a thread of this process",
    )
    return ap.parse_args()


@contextlib.contextmanager
def fresh_schema(base_url: str) -> Iterator[str]:
    """A URL whose connections use a new, empty schema; the schema is dropped afterwards."""
    with scratch_schema(normalize_database_url(base_url), "bench_") as url:
        yield url


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """uvicorn on a free port in a thread (the app's lifespan migrates the schema)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


SERVER_PIDS: dict[str, int] = {}
"""The pid of each server serve_subprocess started, by base URL (bench/big_sweep.py reads its
memory)."""


@contextlib.contextmanager
def serve_subprocess(url: str) -> Iterator[str]:
    """`run_server` (uvicorn, no scheduler) in its own process: no GIL shared with the client."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys; from service.app import run_server; from service.core.config import "
        "Settings; run_server(Settings(database_url=sys.argv[1]), '127.0.0.1', "
        "int(sys.argv[2]), with_scheduler=False)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, url, str(port)],
        cwd="/",  # not bench/: this file's name would shadow the package there
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    SERVER_PIDS[base] = proc.pid
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the server process exited")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}{API}/healthz").status_code == 200:
                    break
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


def spec_cells(cells: int, n: int) -> dict[str, Any]:
    """A dense sweep of `cells` cells (a multiple of 100): lengths x 100 batch sizes."""
    return {
        "name": f"bench-{cells // 1000}k-{n}",
        "base": {"kernel": "dense", "num_heads": 8, "head_dim": 64},
        "grid": {
            "seq_len": [1024 * (i + 1) for i in range(cells // 100)],
            "batch_size": list(range(1, 101)),
        },
    }


def spec_10k(n: int) -> dict[str, Any]:
    return spec_cells(10_000, n)


def fill_runs(sessionmaker: Any, target: int) -> int:
    """Bulk-insert synthetic runs (one sweep per 10,000) until the run table holds `target`."""
    rng = random.Random(0)
    kernels = ["dense", "ring", "dilated", "block_sparse"]
    statuses = list(RunStatus)
    with sessionmaker() as session:
        have = session.scalar(select(func.count()).select_from(Run)) or 0
        added = 0
        while have + added < target:
            chunk = min(10_000, target - have - added)
            sweep = Sweep(name=f"bench-fill-{added}", kind=SweepKind.benchmark, spec={})
            session.add(sweep)
            session.flush()
            now = utcnow()
            rows = []
            for i in range(chunk):
                kernel = rng.choice(kernels)
                world = rng.choice([1, 2, 4, 8])
                seq_len = 1024 * world * rng.randint(1, 128)
                dtype = rng.choice(["float32", "bfloat16", "float16"])
                config = RunConfig.model_construct(
                    kernel=kernel, seq_len=seq_len, world_size=world, dtype=dtype, params={}
                ).model_dump(mode="json")
                config["i"] = i  # distinct cells
                rows.append(
                    {
                        "sweep_id": sweep.id,
                        "cell_key": cell_key_of(config),
                        "cell_config": config,
                        "kernel": kernel,
                        "seq_len": seq_len,
                        "world_size": world,
                        "dtype": dtype,
                        "mode": "forward",
                        "causal": False,
                        "status": rng.choice(statuses),
                        "attempts": 1,
                        "created_at": now,
                    }
                )
            session.execute(insert(Run), rows)
            session.commit()
            added += chunk
        # What autovacuum does soon after a bulk load: statistics for the planner, and the
        # visibility map that lets counts read only the index.
        with session.get_bind().connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE run"))
        return have + added


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _print_setup(args: argparse.Namespace) -> None:
    """The machine, its load, the database and how the service is served."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"setup: {os.cpu_count()} CPUs (load average {load}), Postgres at ")
    print(
        f"       {args.database_url.split('@')[-1]}, uvicorn (1 worker), httpx keep-alive client,"
    )
    where = "a subprocess (run_server)" if args.separate_process else "a thread of this process"
    print(f"       served from {where}; times measured at the client")


def _bench_posts(http: httpx.Client, posts: int) -> None:
    """Time `posts` POSTs of a 10,000-cell sweep, and validation + expansion alone (3 times,
    in this process); one line (SystemExit when a POST fails)."""
    post_s = []
    for n in range(posts):
        body = spec_10k(n)
        t0 = time.perf_counter()
        r = http.post(f"{API}/sweeps", json=body)
        post_s.append(time.perf_counter() - t0)
        if r.status_code != 201 or r.json()["total"] != 10_000:
            raise SystemExit(f"POST failed: {r.status_code} {r.text[:300]}")
    expand_s = []
    for n in range(3):  # the validation + expansion share of a POST, in this process
        t0 = time.perf_counter()
        assert len(expand(SweepSpec.model_validate(spec_10k(n)))) == 10_000
        expand_s.append(time.perf_counter() - t0)
    print(
        f"POST /sweeps, 10,000 cells: {len(post_s)} requests; median "
        f"{statistics.median(post_s):.3f} s, min {min(post_s):.3f} s, max "
        f"{max(post_s):.3f} s (target <= 1 s); of which validation + expansion "
        f"alone: median {statistics.median(expand_s):.3f} s over {len(expand_s)} runs"
    )


def _bench_post_sizes(http: httpx.Client, posts: int, sizes: list[int]) -> None:
    """For each size, `posts` POSTs of a sweep of that many cells (after one untimed of 1,000
    cells, which warms the connection pool and the imports), a line each: the POST at the
    client (its median also as a multiple of the first size's, which a loaded machine slows
    alike), and validation + expansion alone in this process."""
    http.post(f"{API}/sweeps", json=spec_cells(1_000, -1)).raise_for_status()
    first = 0.0  # the first size's median: the others are read against it
    for i, cells in enumerate(sizes):
        post_s = []
        for n in range(posts):
            t0 = time.perf_counter()
            r = http.post(f"{API}/sweeps", json=spec_cells(cells, n))
            post_s.append(time.perf_counter() - t0)
            if r.status_code != 201 or r.json()["total"] != cells:
                raise SystemExit(f"POST failed: {r.status_code} {r.text[:300]}")
        t0 = time.perf_counter()
        assert sum(1 for _ in iter_cells(SweepSpec.model_validate(spec_cells(cells, 0)))) == cells
        expand_s = time.perf_counter() - t0
        median = statistics.median(post_s)
        first = first if i else median
        ratio = f" ({median / first:.1f}x the {sizes[0]:,}-cell median)" if i else ""
        print(
            f"POST /sweeps, {cells:,} cells: {posts} requests; median {median:.3f} s{ratio}, "
            f"min {min(post_s):.3f} s, max {max(post_s):.3f} s; validation + expansion alone "
            f"{expand_s:.3f} s"
        )


def _bench_pages(http: httpx.Client, args: argparse.Namespace, total: int) -> dict[str, list[str]]:
    """Walk each of FILTERS by cursor (--depth pages of --limit runs, after a warm-up), a line
    per filter and one for every request together; returns the cursors the walks met, by
    filter (report_offsets compares the pages by skip with them)."""
    for f in FILTERS[:3]:  # warm the connection pool and plans
        http.get(f"{API}/runs", params={**f, "limit": args.limit}).raise_for_status()
    get_s: list[float] = []
    cursors: dict[str, list[str]] = {}
    for f in FILTERS:
        if f.get("sweep_id") == "first filled":
            f = {**f, "sweep_id": args.posts + 1}
        times, matched, walked = walk_pages(http, f, args.limit, args.depth, cursors)
        get_s += times
        print(
            f"  {canonical_json(f)}: {matched} match; {walked:,} pages of "
            f"{args.limit} walked by cursor, p50 {pct(times, 0.5) * 1e3:.1f} ms, p95 "
            f"{pct(times, 0.95) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms"
        )
    print(
        f"GET /runs pages of {args.limit} with {total:,} runs, up to {args.depth} pages "
        f"deep: {len(get_s):,} requests; p50 {pct(get_s, 0.5) * 1e3:.1f} ms, p95 "
        f"{pct(get_s, 0.95) * 1e3:.1f} ms, max {max(get_s) * 1e3:.1f} ms (target p95 "
        f"<= 50 ms at 100,000 runs, <= 100 ms at 1,000,000)"
    )
    return cursors


def main() -> None:
    args = parse()
    _print_setup(args)
    with fresh_schema(args.database_url) as url:
        engine = make_engine(url)
        if args.separate_process:
            server = serve_subprocess(url)
        else:
            server = serve(create_app(Settings(database_url=url)))
        with server as base, httpx.Client(base_url=base, timeout=120) as http:
            assert http.get(f"{API}/healthz").status_code == 200
            if args.post_only:
                _bench_post_sizes(http, args.posts, [int(n) for n in args.sizes.split(",")])
                return
            _bench_posts(http, args.posts)
            t0 = time.perf_counter()
            total = fill_runs(make_sessionmaker(engine), args.runs)
            fill_s = time.perf_counter() - t0
            print(f"run table: {total:,} runs (bulk fill + VACUUM ANALYZE {fill_s:.1f} s)")
            cursors = _bench_pages(http, args, total)
            report_offsets(http, args, cursors)
            engine.dispose()


OFFSET_BANDS = [(0, 2_000), (2_000, 10_000)]
"""The depths a page by `skip` is read at: a UI's first pages, then deep ones (MAX_SKIP)."""


def report_offsets(
    http: httpx.Client, args: argparse.Namespace, cursors: dict[str, list[str]]
) -> None:
    """For each depth band, pages by `skip` at evenly spread offsets of every filter, with the
    count (the first page of a listing) and without it (`count=false`: a client that has it);
    each followed at once by the page at the same depth by cursor (one walk_pages kept), so
    both are timed under the same load."""
    for lo, hi in OFFSET_BANDS:
        for with_count in (True, False):
            by_skip: list[float] = []
            by_cursor: list[float] = []
            for f in FILTERS:
                if f.get("sweep_id") == "first filled":
                    f = {**f, "sweep_id": args.posts + 1}
                walked = cursors[canonical_json(f)]
                for i in range(args.offsets):
                    skip = lo + (hi - lo) * i // args.offsets
                    query = {**f, "limit": args.limit}
                    if not with_count:
                        query["count"] = "false"
                    by_skip.append(timed_get(http, {**query, "skip": skip}))
                    page = skip // args.limit
                    if 0 < page <= len(walked):  # the walk reached this depth
                        by_cursor.append(timed_get(http, {**query, "cursor": walked[page - 1]}))
            label = "with count" if with_count else "count=false"
            print(
                f"GET /runs at depth [{lo:,}, {hi:,}), {label}, {len(FILTERS)} filters: by skip "
                f"{len(by_skip):,} requests, p50 {pct(by_skip, 0.5) * 1e3:.1f} ms, p95 "
                f"{pct(by_skip, 0.95) * 1e3:.1f} ms, max {max(by_skip) * 1e3:.1f} ms (target "
                f"p95 <= 50 ms under 2,000); by cursor at the same depths {len(by_cursor):,} "
                f"requests, p50 {pct(by_cursor, 0.5) * 1e3:.1f} ms, p95 "
                f"{pct(by_cursor, 0.95) * 1e3:.1f} ms"
            )


def timed_get(http: httpx.Client, params: dict[str, Any]) -> float:
    """Seconds one GET /runs took, at the client; a failed request stops the bench."""
    t0 = time.perf_counter()
    http.get(f"{API}/runs", params=params).raise_for_status()
    return time.perf_counter() - t0


def walk_pages(
    http: httpx.Client,
    params: dict[str, Any],
    limit: int,
    depth: int,
    cursors: dict[str, list[str]],
) -> tuple[list[float], str, int]:
    """Follow `next` from the first page for up to `depth` pages: each request's time, the
    count as the API labels it, and the pages walked. The `next` of each page goes into
    cursors[canonical_json(params)] (the k-th opens the page at row (k + 1) * limit)."""
    times: list[float] = []
    cursor: str | None = None
    matched = "?"
    kept = cursors.setdefault(canonical_json(params), [])
    for _ in range(depth):
        query = {**params, "limit": limit, **({"cursor": cursor} if cursor else {})}
        t0 = time.perf_counter()
        r = http.get(f"{API}/runs", params=query)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
        body = r.json()
        if cursor is None:
            matched = f"{body['count']:,}" + ("" if body["count_exact"] else "+")
        cursor = body["next"]
        if cursor is None:
            break
        kept.append(cursor)
    return times, matched, len(times)


if __name__ == "__main__":
    main()
