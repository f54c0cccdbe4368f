"""Recovery after a crash: kill -9 a `ringlab serve` (API, scheduler, local Ray) while a run is
running, restart it, and print how long after the restart the run was queued or running again.

    .venv/bin/python bench/recovery.py [--port 8123] [--down-s 1]
"""

import argparse
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

import httpx

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--port", type=int, default=8123)
ap.add_argument(
    "--down-s", type=float, default=1.0, help="seconds between the kill and the restart"
)
args = ap.parse_args()
print(f"setup: {os.cpu_count()} CPUs, SQLite, `ringlab serve` with its scheduler and a local Ray")
d = tempfile.mkdtemp()
env = {**os.environ, "RINGLAB_DATABASE_URL": f"sqlite:///{d}/r.db"}
env.pop("RINGLAB_RAY_ADDRESS", None)
port = args.port


def start():
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(f"{d}/log", "a"),
        start_new_session=True,
    )


base = f"http://127.0.0.1:{port}/api/v1"
p = start()
for _ in range(120):
    try:
        if httpx.get(base + "/healthz").status_code == 200:
            break
    except httpx.TransportError:
        pass
    time.sleep(0.5)
spec = {
    "name": "long",
    "base": {
        "kernel": "dense",
        "num_heads": 2,
        "head_dim": 16,
        "device": "cpu",
        "iterations": 100000,
        "timeout_s": 3000,
    },
    "grid": {"seq_len": [512, 1024]},
}
sid = httpx.post(base + "/sweeps", json=spec).json()["id"]
while True:
    runs = httpx.get(base + "/runs", params={"sweep_id": sid}).json()["data"]
    running = [r for r in runs if r["status"] == "running"]
    if running:
        break
    time.sleep(0.5)
rid = running[0]["id"]
time.sleep(6)
os.killpg(p.pid, signal.SIGKILL)
p.wait()
print("killed while run", rid, "was running")
time.sleep(args.down_s)
t0 = time.monotonic()
p = start()
while True:
    row = (
        sqlite3.connect(f"{d}/r.db")
        .execute("select status, attempts from run where id=?", (rid,))
        .fetchone()
    )
    if row[0] != "running" or row[1] > 1:
        print(
            f"run {rid}: {row[0]} (attempts {row[1]}) "
            f"{time.monotonic() - t0:.1f} s after the restart (target <= 10 s)"
        )
        if row[1] > 1 or row[0] == "queued":
            break
    time.sleep(0.2)
os.killpg(p.pid, signal.SIGINT)
p.wait(60)
