"""The node's matmul rate: a square GEMM in the run's dtype on the rank's device, measured once
per node and kept for the node's lifetime, so that a kernel's FLOP/s reads as a fraction of what
this device does on a plain matmul (on CPU as on GPU).

The size doubles from MIN_SIZE until the best of PROBE_REPEATS products takes PROBE_TARGET_S (or
reaches the device's MAX_SIZE); the rate is that best: 2 n^3 / seconds. The
probe takes a fraction of a second. It is cached in a file per (boot, host, device, dtype, CPU
threads) under the system's temporary directory: ranks of later runs on the same node read
it instead of measuring again, and the ranks of one gang that share a node wait on the file's
lock while one of them measures, so they do not contend with each other's probe. A reboot
(a new boot id) measures afresh.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROBE_TARGET_S = 0.02
"""Seconds one product should reach before the size stops doubling."""
PROBE_REPEATS = 3
MIN_SIZE = {"cpu": 1024, "cuda": 2048}
"""Smallest side probed per device type: a smaller product times its call, not the rate, and
one slowed by a busy node would stop the doubling there and be kept for the node's lifetime
(a 256-wide fp32 product once read 0.4 GFLOP/s on a loaded 2-core node)."""
MAX_SIZE = {"cpu": 2048, "cuda": 8192}
"""Largest side probed per device type: a few hundred ms at most on one CPU thread in fp32."""
CACHE_DIR = Path(tempfile.gettempdir()) / "ringlab-matmul"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class MatmulRate:
    """One probe: the dtype and side of the square product, its best seconds, and the rate."""

    dtype: str
    size: int
    seconds: float

    @property
    def flops_per_s(self) -> float:
        """2 n^3 / seconds: the multiply-adds of an (n, n) @ (n, n) product, as FLOPs."""
        return 2 * self.size**3 / self.seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """The fastest of `repeats` (size, size) @ (size, size) products (after one untimed)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(device, dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype, device=device)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(device: torch.device, dtype: torch.dtype) -> MatmulRate:
    """Probe now (no cache): the size doubles until the best of PROBE_REPEATS products takes
    PROBE_TARGET_S (the best: one preempted product does not stop the doubling early)."""
    if device.type not in MAX_SIZE:
        raise ValueError(f"device: the matmul probe runs on cpu or cuda, got {device}")
    size = MIN_SIZE[device.type]
    seconds = _best_seconds(device, dtype, size, PROBE_REPEATS)
    while size < MAX_SIZE[device.type] and seconds < PROBE_TARGET_S:
        size *= 2
        seconds = _best_seconds(device, dtype, size, PROBE_REPEATS)
    return MatmulRate(str(dtype).removeprefix("torch."), size, seconds)


def _device_key(device: torch.device) -> str:
    """What the rate belongs to: the GPU (its uuid), or the CPU at this process's threads."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda {torch.cuda.get_device_properties(index).uuid}"
    return f"cpu threads={torch.get_num_threads()}"


def boot_id() -> str:
    """This boot of the node (Linux's boot id; elsewhere the boot time to the second)."""
    if BOOT_ID.exists():
        return BOOT_ID.read_text().strip()
    return str(round(time.time() - time.monotonic()))


def node_rate(device: torch.device, dtype: torch.dtype, cache_dir: Path = CACHE_DIR) -> MatmulRate:
    """The node's rate for (device, dtype): the cached probe of this boot, else a new one,
    stored. Ranks asking at once wait on one lock; one measures, the others read it."""
    how = [MIN_SIZE.get(device.type), MAX_SIZE.get(device.type), PROBE_TARGET_S, PROBE_REPEATS]
    key = json.dumps(  # how it probes too: a probe of other rules is not this one's
        [boot_id(), socket.gethostname(), _device_key(device), str(dtype), how],
        separators=(",", ":"),
    )
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{name}.json"
    with open(cache_dir / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            stored = json.loads(path.read_text())
            if stored.get("key") != key:
                raise RuntimeError(f"{path}: cached for {stored.get('key')!r}, not {key!r}")
            return MatmulRate(stored["dtype"], stored["size"], stored["seconds"])
        rate = measure(device, dtype)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **asdict(rate)}))
        tmp.replace(path)
        return rate
