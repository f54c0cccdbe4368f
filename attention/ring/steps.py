"""Where a ring kernel's time goes: per step, compute and time blocked on a transfer.

The ring kernels open `clock.step(phase, index)` around each step of their loop; RingComm and
`exchange` time every wait on a transfer (`clock.waiting()`) and report each transfer: the bytes
sent count in the step that posts it, the bytes received in the step where it completes, with
the transfer's window (from posting to completion). A step's compute time is its whole duration
minus its waits, so the steps of one call tile its ring loop without gaps and their sum
accounts for the call (what lies outside is setup: the shape check's all-gather, allocations,
the layout change of ring_dilated). A step's wait is whatever it blocked on: in `ring` the K/V
of the next step (posted at this step's start), in `ring_block_sparse` this step's own (posted
during the previous step), and in both the dK/dV sent on by the previous step.

A transfer's bytes over its window say how fast the ring's transfers completed in the run, not
how fast the link is: the window includes the time the peer took to post its side (the ranks'
skew), which on loopback read 14-46 MiB/s where gloo moves 1.6-2.6 GB/s. A step reports the
best of its transfers (K and V travel as two concurrent messages). The link itself is measured
apart, by a ping-pong before the timed loop (workers.link).

What a step is, per kernel:
- `ring`, `ring_block_sparse`: step t computes with the K/V of rank - t (mod W) while the next
  step's arrive; backward step W is the wait for the last dK/dV to come home (with several
  pieces on CPU, an earlier piece's dK/dV arrive home during the next piece's step 0).
- `ring_dilated`: step 0 is the segments inside this rank's shard (no communication), step i the
  i-th segment shared with other ranks, whose gather (and in the backward, dK/dV return) is
  blocking: LongNet's algorithm has nothing to overlap it with.

A step whose held K/V keep no pair with this rank's queries (an empty plan step: `ring`, and
`usp`'s ring, call `computes(False)`) computes nothing and says so: its row is `skipped`
(its K/V still travel on, its waits still count). Kernels that never call `computes` report
no step skipped.

Steps with the same (phase, index) add up: on CPU a shard's K/V travel the ring a piece at a
time (engine.cut_pieces), and every piece's step t is the hop of rank - t's K/V.

Timing uses time.perf_counter on CPU. On CUDA it records CUDA events on the current stream
(a wait on an NCCL transfer blocks the stream, not the host), read when the iteration is
collected, after the caller synchronized. Off (the default) a step costs two attribute
reads; on, a few perf_counter calls per step: bench/ring.py measures the difference.

`start(device, thread_time=True)` (CPU only) also reads the calling thread's CPU time
(time.thread_time) at the same marks, and each row gains `compute_thread_s`: the step's CPU
time minus its waits'. On an oversubscribed machine a preempted step's wall time grows and its
CPU time does not, so that figure says the work a rank did, not how the scheduler treated it
(bench/documents.py prints both). It counts this thread only: with one intra-op thread the
compute runs on it; gloo's transfers run on threads of their own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("forward", "backward")


@dataclass
class _Step:
    """One open or finished (phase, index) of the current iteration: marks, not yet seconds."""

    spans: list[tuple[Any, Any]] = field(default_factory=list)  # (start, end) of each visit
    waits: list[tuple[Any, Any]] = field(default_factory=list)
    thread_spans: list[tuple[float, float]] = field(default_factory=list)  # thread CPU time
    thread_waits: list[tuple[float, float]] = field(default_factory=list)
    transfers: list[tuple[int, Any, Any]] = field(default_factory=list)  # (bytes, posted, done)
    sent_bytes: int = 0
    received_bytes: int = 0
    computed: bool | None = None  # None: not said (computes never called); else any visit did


class StepClock:
    """The process-wide recorder (one rank per process); `enabled` False records nothing."""

    def __init__(self) -> None:
        self.enabled = False
        self._cuda = False
        self._thread = False
        self._steps: dict[tuple[str, int], _Step] = {}
        self._open: _Step | None = None

    def start(self, device: torch.device, thread_time: bool = False) -> None:
        """Record from now on, with the clock of `device`, into a fresh iteration;
        `thread_time`: also the thread's CPU time of each step (CPU only)."""
        if thread_time and device.type != "cpu":
            raise ValueError(f"thread_time: CPU time of a step needs a cpu device, got {device}")
        self.enabled = True
        self._cuda = device.type == "cuda"
        self._thread = thread_time
        self._steps = {}
        self._open = None

    def stop(self) -> None:
        """Stop recording and drop whatever was not collected."""
        self.enabled = False
        self._thread = False
        self._steps = {}
        self._open = None

    def mark(self) -> Any:
        """Now, on the clock in use (None when off): a transfer's posting time."""
        return self._mark() if self.enabled else None

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3 if self._cuda else float(b - a)

    @contextlib.contextmanager
    def step(self, phase: str, index: int) -> Iterator[None]:
        """Time the body as step `index` of `phase` (forward | backward)."""
        if not self.enabled:
            yield
            return
        entry = self._steps.setdefault((phase, index), _Step())
        outer, self._open = self._open, entry
        try:
            with self._span(entry.spans, entry.thread_spans):
                yield
        finally:
            self._open = outer

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the body as blocked on a transfer, inside the open step."""
        entry = self._open if self.enabled else None
        if entry is None:
            yield
            return
        with self._span(entry.waits, entry.thread_waits):
            yield

    @contextlib.contextmanager
    def _span(
        self, spans: list[tuple[Any, Any]], thread_spans: list[tuple[float, float]]
    ) -> Iterator[None]:
        """Add the body's (start, end) marks to `spans` and, when the thread's CPU time is
        read, its (start, end) thread time to `thread_spans`: what a step and a wait record."""
        start = self._mark()
        cpu = time.thread_time() if self._thread else 0.0
        try:
            yield
        finally:
            spans.append((start, self._mark()))
            if self._thread:
                thread_spans.append((cpu, time.thread_time()))

    def computes(self, anything: bool) -> None:
        """Whether the open step's visit computes anything (False: its plan step is empty);
        the step is skipped when no visit computed."""
        if self.enabled and self._open is not None:
            self._open.computed = bool(self._open.computed) or anything

    def sent(self, nbytes: int) -> None:
        """Bytes a transfer posted inside the open step sends (RingComm.start, exchange)."""
        if self.enabled and self._open is not None:
            self._open.sent_bytes += nbytes

    def received(self, nbytes: int, posted: Any) -> None:
        """A transfer that received `nbytes` completed now, inside the open step; `posted` is
        `mark()` from when it was posted (None: posted while the clock was off, not counted)."""
        if self.enabled and self._open is not None and posted is not None and nbytes:
            self._open.received_bytes += nbytes
            self._open.transfers.append((nbytes, posted, self._mark()))

    def collect(self) -> list[dict[str, Any]]:
        """The iteration's steps as rows (phase, step, compute_s, wait_s, sent_bytes,
        received_bytes, transfer_window_bytes_per_s: the best bytes / window of the transfers
        completed in the step, None without any; skipped: the step computed nothing, its held
        K/V keeping no pair with this rank's queries), in phase and step order, and a fresh
        iteration begins; with thread_time, also compute_thread_s. On CUDA the caller has
        synchronized the device."""
        rows = []
        for (phase, index), entry in sorted(
            self._steps.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1])
        ):
            total = sum(self._seconds(a, b) for a, b in entry.spans)
            wait = sum(self._seconds(a, b) for a, b in entry.waits)
            row: dict[str, Any] = {
                "phase": phase,
                "step": index,
                "compute_s": max(0.0, total - wait),
                "wait_s": wait,
                "sent_bytes": entry.sent_bytes,
                "received_bytes": entry.received_bytes,
                "transfer_window_bytes_per_s": max(
                    (n / t for n, a, b in entry.transfers if (t := self._seconds(a, b)) > 0),
                    default=None,
                ),
                "skipped": entry.computed is False,
            }
            if self._thread:
                cpu = sum(b - a for a, b in entry.thread_spans)
                row["compute_thread_s"] = max(0.0, cpu - sum(b - a for a, b in entry.thread_waits))
            rows.append(row)
        self._steps = {}
        return rows


clock = StepClock()
"""The recorder every ring kernel reports to (workers.protocol starts and collects it)."""
