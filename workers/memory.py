"""Peak memory of exactly one case: CUDA allocator stats, or the process' peak RSS on Linux CPU."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

_T = TypeVar("_T")
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from {_STATUS}")


def cpu_peak_supported() -> bool:
    """Linux with a writable clear_refs: the only place the CPU peak can be reset."""
    return _STATUS.exists() and _CLEAR_REFS.exists()


def release(collect_cycles: bool = False) -> None:
    """Give freed memory back: the CUDA cache and glibc's heap (see reference.md).

    collect_cycles also runs the garbage collector (~0.1 s): after an OOM, whose traceback
    may keep tensors alive in reference cycles.
    """
    if collect_cycles:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD = 64 * 1024
HEAP_TRIM_THRESHOLD = 128 * 1024  # glibc's default
KEEP_MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
KEEP_TRIM_THRESHOLD = 2 * KEEP_MMAP_THRESHOLD  # what glibc's dynamic threshold pairs it with


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    trimmed = libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and trimmed)


def heap_follows_tensors() -> bool:
    """Make glibc serve every allocation of 64 KiB or more by its own mmap, returned to the
    system when freed (process-wide). glibc's default threshold grows to 32 MiB, so freed
    tensors below it stay in the heap and the resident set (what the CPU meter reads) counts
    fragmentation as if it were tensors: measured here, a model's forward transient read 1.33x
    its logits with the default and 1.00x with this. Returns whether it applied.

    The price is a page fault per page of every fresh allocation: on the 2-core VM, 2-3 ms
    per 2.9 MB tensor. Time therefore under `heap_keeps_freed`, never under this."""
    return _mallopt(HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD)


@contextlib.contextmanager
def heap_keeps_freed() -> Iterator[None]:
    """Within: glibc keeps freed memory below 32 MiB for reuse, as its default heap does once
    warm (its dynamic mmap threshold rises to the largest freed chunk, up to 32 MiB). Timings
    are taken here, so a kernel that allocates many block-sized results is not charged the page
    faults of `heap_follows_tensors` (measured: block_sparse at block 64, 16K tokens, forward
    0.80-0.82x of SDPA's FLOP/s under it, 0.89-0.93x here). On exit the heap follows the
    tensors again and what was kept is given back (`release`). Freed chunks stay in glibc's
    bins (not resident) and are reused by later allocations that fit: a peak metered after
    this counts that fragmentation, so meter before timing (bench/kernels.py does).
    Reuse settles after some rounds (about ten of 1 MiB tensors here)."""
    _mallopt(KEEP_MMAP_THRESHOLD, KEEP_TRIM_THRESHOLD)
    try:
        yield
    finally:  # both thresholds back, whichever of the two calls took
        heap_follows_tensors()
        release()


@functools.cache
def _metering_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringlab-meter")


def on_metering_thread(fn: Callable[[], _T]) -> _T:
    """fn() run on the process' one metering thread (with the caller's torch thread count);
    its result returned, its exception raised.

    Why: glibc gives each thread its own malloc arena, and an arena keeps the chunks freed in
    it. The timed iterations run on a heap that keeps freed memory (heap_keeps_freed), so the
    main thread's arena ends a case full of free block-sized chunks; malloc_trim gives their
    pages back, but a later allocation that fits one is served from it and faults it back in,
    page by page, where a fresh allocation would have had its own mapping and returned it. A
    metered iteration on the main thread therefore read more the more chunks earlier cases had
    left: block_sparse (block 128, h4 d32, 2 threads; a search's probes, 2K-32K tokens) read
    1.1-4.3 MB over its floor, and the same case run again 0.2-1.3 MB apart; dense 0.8-1.1 MB.
    On this thread, whose arena only metered iterations use (always on the heap that follows
    the tensors), block_sparse read 1.2-1.7 MB, the same case again within 0.2 MB.

    With more than one torch thread the thread has its own OpenMP team, and once two teams
    exist libgomp throttles its idle workers' spinning (more threads than CPUs): block_sparse
    at block 64 (16K, 2 threads) then ran at 0.815x SDPA's FLOP/s instead of 0.87x on the main
    thread. The service's CPU ranks run one thread each (Ray sets OMP_NUM_THREADS to an
    actor's one CPU), so they have no team; bench.kernels searches after its timings."""
    threads = torch.get_num_threads()

    def call() -> _T:
        if torch.get_num_threads() != threads:  # OpenMP's thread count is per calling thread
            torch.set_num_threads(threads)
        return fn()

    return _metering_thread().submit(call).result()


class PeakMeter:
    """Measures the peak above a baseline on one device: `baseline()`, `reset()`, then `peak()`.

    On CPU it reads the resident set, with glibc's heap set to follow the tensors
    (heap_follows_tensors); time elsewhere, under heap_keeps_freed, and in a process that has
    timed, meter on the metering thread (on_metering_thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0
        if device.type == "cpu":
            if not cpu_peak_supported():
                raise RuntimeError("CPU peak memory needs Linux /proc/self/clear_refs")
            heap_follows_tensors()

    def baseline(self) -> int:
        """Record what is resident before the inputs exist; returns it in bytes."""
        release()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _status_kib("VmRSS") * 1024
        return self._base

    def reset(self) -> None:
        """Start the peak from what is resident now (inputs included)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            release()
            _CLEAR_REFS.write_text("5")

    def current(self) -> int:
        """What is resident now above the baseline, in bytes (never negative)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = torch.cuda.memory_allocated(self.device)
        else:
            now = _status_kib("VmRSS") * 1024
        return max(0, now - self._base)

    def peak(self) -> int:
        """Peak since reset() above the baseline, in bytes (never negative)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            high = torch.cuda.max_memory_allocated(self.device)
        else:
            high = _status_kib("VmHWM") * 1024
        return max(0, high - self._base)


_SIZE = re.compile(r"(?:allocate|allocating)\s+([0-9.]+)\s*(bytes|KiB|MiB|GiB|TiB|B)?", re.I)
_UNITS = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def requested_bytes(message: str) -> int | None:
    """The failed allocation's size from an OOM message ("Tried to allocate 2.00 GiB"...)."""
    match = _SIZE.search(message)
    if not match:
        return None
    unit = (match.group(2) or "bytes").lower()
    return int(float(match.group(1)) * _UNITS[unit])


def is_oom(exc: BaseException) -> bool:
    """A CUDA OOM or a CPU allocation failure (both leave the process usable once freed)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and (
        "DefaultCPUAllocator: can't allocate memory" in str(exc) or "CUDA out of memory" in str(exc)
    )
