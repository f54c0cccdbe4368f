"""The CPU meter's heap setting and the timing heap, read off glibc itself (mallinfo2): a peak
is metered with every tensor in its own mapping; bench timings run where freed memory is reused."""

from __future__ import annotations

import ctypes

import torch

from workers.memory import heap_follows_tensors, heap_keeps_freed

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mapped_chunks() -> int:
    """Allocations glibc serves by their own mmap right now."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblks)


def _mapped(nbytes: int) -> bool:
    """Whether a fresh tensor of `nbytes` gets its own mapping (page faults on first touch)."""
    before = _mapped_chunks()
    t = torch.ones(nbytes, dtype=torch.uint8)  # touched, as a kernel's result would be
    mapped = _mapped_chunks() > before
    del t
    return mapped


def test_the_meter_maps_each_tensor_and_the_timing_heap_reuses_freed_memory() -> None:
    heap_follows_tensors()
    # Sizes no earlier test leaves free in the heap (a freed chunk that fits is reused in
    # either setting).
    assert _mapped(16 * MIB)
    with heap_keeps_freed():
        torch.ones(16 * MIB, dtype=torch.uint8)  # freed into the heap ...
        assert not _mapped(16 * MIB)  # ... and reused: no page faults
        assert _mapped(40 * MIB)  # above 32 MiB glibc maps even when warm
    assert _mapped(24 * MIB), "leaving the timing heap must restore the meter's setting"
