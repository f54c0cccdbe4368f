"""Peak memory of exactly one case, with CUDA's meaning on every device: the bytes the device's
allocator handed out. On CUDA the caching allocator's stats; on CPU c10's CPU allocator, read
through torch.profiler's memory events (the ops' own internal buffers included). The process'
resident-set high-water mark stays as a second CPU figure, named as such."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch._C._autograd import (
    _disable_profiler,
    _enable_profiler,
    _prepare_profiler,
    _ProfilerResult,
)
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _ExperimentalConfig,
    _ExtraFields_Allocation,
    _ProfilerEvent,
)

from attention.errors import is_allocation_failure

log = logging.getLogger(__name__)

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


def resident_peak_supported() -> bool:
    """Linux with a writable clear_refs: the only place the resident-set peak can be reset."""
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


def _walk(nodes: list[_ProfilerEvent]) -> Iterator[_ProfilerEvent]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _allocations(result: _ProfilerResult) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU allocation (bytes > 0) and free (bytes < 0) a stopped
    session recorded, in time order."""
    timed = []
    for node in _walk(result.experimental_event_tree()):
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
            timed.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    timed.sort(key=lambda row: row[0])
    return [(ptr, size) for _, ptr, size in timed]


SESSION_SCOPES = {RecordScope.BUILD_FEATURE}
"""The op scopes a meter's session records: one nothing the meter runs opens, so it records
allocations only. The default (every scope) includes USER_SCOPE, the RecordFunction that c10d's
Work starts when a transfer is posted and ends on gloo's thread when the transfer completes,
which raced with the session: a rank whose ring transfers completed while its session
recorded or stopped could die by SIGSEGV (seen when a peer ran out of memory mid-ring)."""


def _start_session() -> None:
    """Start a kineto session that records the CPU allocator's allocations and frees: what
    torch.profiler.profile(activities=[CPU], profile_memory=True) starts, without its op events
    (SESSION_SCOPES) and without that wrapper's preparation, which reads `torch._inductor` and
    so imports Dynamo (about a second of CPU in every rank process that meters a case)."""
    config = ProfilerConfig(
        ProfilerState.KINETO,
        report_input_shapes=False,
        profile_memory=True,
        with_stack=False,
        with_flops=False,
        with_modules=False,
        experimental_config=_ExperimentalConfig(),
    )
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU}, SESSION_SCOPES)


class CpuAllocatorLedger:
    """The bytes c10's CPU allocator handed out since `start()` and still holds, and their
    high-water mark: torch.cuda.memory_allocated / max_memory_allocated for the CPU.

    c10's CPU allocator reports every allocation and free to the profiler of the calling
    thread (ProfiledCPUMemoryReporter), so a torch.profiler session with profile_memory=True
    sees every tensor and every buffer an op allocates inside itself (the CPU flash op's
    per-thread scratch, autograd's temporaries), wherever the Python code cannot. A session's
    events are only readable once it stops, so each reading stops it, folds its allocation
    events (in time order, by address) into the ledger and starts the next one: nothing runs
    between the two. Only frees of blocks allocated since `start()` count; a free of an older
    block (garbage of earlier work) leaves the ledger alone, so a figure does not depend on
    what the process did before.

    Not seen: allocations and frees made on other threads than the one that started the
    ledger (the reporter is thread-local; OpenMP's worker threads and Python threads do not
    inherit it, autograd's do). The ops ringlab runs allocate on the calling thread and a
    parallel region only uses buffers allocated before it (measured: the flash op's scratch,
    sized by the thread count, reads exactly twice as much at 2 threads as at 1); a block freed
    unseen is dropped when its address is handed out again. Nor memory that does not come from
    c10's allocator (MKL's or oneDNN's own workspaces). Only one profiler session can exist in
    a process: start() refuses to run under another one.
    """

    def __init__(self) -> None:
        self._session = False
        self._live: dict[int, int] = {}
        self._current = 0
        self._high = 0

    @property
    def running(self) -> bool:
        return self._session

    def start(self) -> None:
        """Forget what was counted and start counting from zero bytes."""
        if self._session:
            self.stop()
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError(
                "the CPU peak meter needs torch.profiler's memory events, and another profiler "
                "session is active on this thread (torch allows one at a time)"
            )
        self._live.clear()
        self._current = self._high = 0
        self._open()

    def _open(self) -> None:
        """Start a session (_start_session)."""
        _start_session()
        self._session = True

    def _fold(self) -> None:
        """Stop the session and fold its CPU allocations and frees into the ledger."""
        if not self._session:
            raise RuntimeError("the CPU allocator ledger is not running: call start() first")
        self._session = False
        for ptr, size in _allocations(_disable_profiler()):
            if size > 0:
                # An address handed out again was freed unseen (on another thread): drop it.
                self._current += size - self._live.get(ptr, 0)
                self._live[ptr] = size
                self._high = max(self._high, self._current)
            else:
                self._current -= self._live.pop(ptr, 0)

    def sync(self) -> None:
        """Bring the ledger up to now (the session restarts at once)."""
        self._fold()
        self._open()

    def stop(self) -> None:
        """Fold what the session saw and end it (idempotent): nothing more is counted."""
        if self._session:
            self._fold()

    def _running(self) -> None:
        """Refuse a reading when nothing is being counted (before start(), after stop())."""
        if not self._session:
            raise RuntimeError("the CPU allocator ledger is not running: start() it first")

    def current(self) -> int:
        """Bytes allocated since start() and still held."""
        self._running()
        self.sync()
        return self._current

    def reset_peak(self) -> None:
        """The high-water mark restarts from what is held now."""
        self._running()
        self.sync()
        self._high = self._current

    def peak(self) -> int:
        """The most bytes held at once since start() or the last reset_peak()."""
        self._running()
        self.sync()
        return self._high


def cuda_used_bytes(device: torch.device) -> int:
    """The device's used bytes now (cudaMemGetInfo: total - free), device-wide: the caching
    allocator's reserve (cached blocks included), NCCL's communicator buffers, cuBLAS/cuDNN
    workspaces, the CUDA context and its loaded kernels, and any other process on the device."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def used_growth(before: int, after: int) -> int:
    """Bytes the device's use grew by between two cuda_used_bytes readings (never negative, as
    the meter's other figures: a reading below the baseline means something else freed)."""
    return max(0, after - before)


class DeviceUsed:
    """A CUDA rank's device-wide used bytes at its baseline and later (`read`: a reading of
    them, cuda_used_bytes by default): what max_memory_allocated cannot see, NCCL's buffers and
    the libraries' workspaces above all, beside the allocator's peak."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._base: int | None = None

    def baseline(self) -> None:
        self._base = self._read()

    def growth(self) -> int:
        """used_growth from the baseline to now."""
        if self._base is None:
            raise RuntimeError("the device-used reading has no baseline: call baseline() first")
        return used_growth(self._base, self._read())


class PeakMeter:
    """Memory of one case above a baseline, with torch.cuda.max_memory_allocated's meaning on
    every device: the bytes the device's allocator handed out, the ops' internal buffers
    included. `baseline()` before the inputs exist, `current()` (after the inputs: memory
    after inputs), `reset()`, then `peak()`; `stop()` when done.

    CUDA: the caching allocator's stats. CPU: a CpuAllocatorLedger (c10's CPU allocator through
    torch.profiler), so the figure is the same in a fresh process and in one whose heap earlier
    work left resident, and never below the tensors held. A second CPU figure,
    `resident_peak()`, is the process' resident-set high-water mark above the baseline (VmHWM
    after a clear_refs reset, Linux), read when peak() is: what the OS saw, glibc's heap reuse
    and fragmentation included (it misses heap pages earlier work left resident, so it can
    read below the inputs), never the allocator's figure. It also holds the profiler's own
    records of the metered work (measured: +0.5 MB over a block_sparse forward at 8K tokens,
    +2-8 MB over its backward at 4K); it is read before the events are processed, which would
    add 5-8 MB more.

    The CPU ledger runs a profiler session from baseline() to stop(): its overhead (measured
    1.0-1.15x over a block_sparse forward or backward, plus 0.03-0.06 s to read the events)
    lands on the metered work only; a caller stops the meter before timing, and no other
    torch.profiler may run meanwhile.

    CUDA also reads the device's used bytes at baseline() and at `device_used()` (DeviceUsed):
    what the device gave the process beyond the allocator's peak, NCCL's buffers included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0
        self._resident_base: int | None = None
        self._resident_high: int | None = None  # read by peak()
        self._ledger = CpuAllocatorLedger() if device.type == "cpu" else None
        self.used: DeviceUsed | None = None
        if device.type == "cuda":
            self.used = DeviceUsed(functools.partial(cuda_used_bytes, device))

    def baseline(self) -> None:
        """What the allocator holds now becomes the zero of every figure (CPU: the ledger
        starts counting here); on CPU also the resident set's zero."""
        release()
        if self._ledger is None:
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            if self.used is not None:
                self.used.baseline()
            return
        self._ledger.start()
        self._resident_high = None
        if resident_peak_supported():
            self._resident_base = _status_kib("VmRSS") * 1024

    def reset(self) -> None:
        """Start the peak from what is held now (inputs included); on CPU also the resident
        set's high-water mark (freed heap given back first, see reference.md)."""
        if self._ledger is None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._ledger.reset_peak()
        if self._resident_base is not None:
            release()
            _CLEAR_REFS.write_text("5")

    def current(self) -> int:
        """What the allocator holds now above the baseline, in bytes (never negative)."""
        if self._ledger is None:
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.memory_allocated(self.device) - self._base)
        return self._ledger.current()

    def peak(self) -> int:
        """Peak the allocator held since reset() above the baseline, in bytes (never
        negative). On CPU also reads the resident figure (resident_peak), first."""
        if self._ledger is None:
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        if self._resident_base is not None:
            high = _status_kib("VmHWM") * 1024
            self._resident_high = max(0, high - self._resident_base)
        return self._ledger.peak()

    def device_used(self) -> int | None:
        """CUDA: the device's used bytes now minus at baseline() (DeviceUsed), read after the
        timed iterations: NCCL's buffers and library workspaces made meanwhile included, and
        the allocator's cached blocks, which peak() leaves out. None elsewhere (on CPU no such
        figure exists: absent, not zero)."""
        if self.used is None:
            return None
        torch.cuda.synchronize(self.device)
        return self.used.growth()

    def resident_peak(self) -> int | None:
        """CPU: the process' resident-set high-water mark from reset() to the last peak(),
        above the baseline's resident set, in bytes (never negative); None on CUDA, without
        clear_refs, or before a peak() was read."""
        return self._resident_high

    def stop(self) -> None:
        """Stop counting (CPU: end the profiler session, so later work runs without it); on
        CPU current(), peak() and reset() refuse until the next baseline(). Idempotent."""
        if self._ledger is not None:
            self._ledger.stop()


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
    """A CUDA OOM or a CPU allocation failure (both leave the process usable once freed);
    the rule lives in attention.errors, which the ring's abort flag reads too."""
    return is_allocation_failure(exc)
