"""The peak meter with CUDA's meaning on CPU: the bytes c10's CPU allocator hands out (through
torch.profiler's memory events), the ops' internal buffers included, independent of what the
process' heap holds from earlier work; the resident-set peak as a second, named figure.

The resident-set meter this replaced (VmHWM after malloc_trim and clear_refs, with glibc's heap
set to follow the tensors and the metered iteration on its own thread) was tested here by page
faults and heap reuse; that machinery had no purpose once the peak stopped being read off the
resident set, and is gone with its tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from _fresh import fresh_json

from workers import memory
from workers.config import RunConfig
from workers.memory import CpuAllocatorLedger, PeakMeter
from workers.protocol import _timed_loop, run_case

CPU = torch.device("cpu")
MIB = 2**20


def _profiling() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


def test_the_ledger_counts_held_bytes_and_their_high_water_mark() -> None:
    """current() is what is held since start(), peak() the most held at once; a block that
    existed before start() and is freed meanwhile leaves both alone (it was never counted)."""
    older = torch.ones(MIB, dtype=torch.uint8)
    ledger = CpuAllocatorLedger()
    ledger.start()
    try:
        held = torch.ones(3 * MIB, dtype=torch.uint8)
        assert ledger.current() == 3 * MIB
        ledger.reset_peak()
        transient = torch.ones(2 * MIB, dtype=torch.uint8)
        del transient, older
        assert ledger.current() == 3 * MIB
        assert ledger.peak() == 5 * MIB
        del held
        assert ledger.current() == 0 and ledger.peak() == 5 * MIB
    finally:
        ledger.stop()
    assert not _profiling()
    with pytest.raises(RuntimeError, match="not running"):
        ledger.peak()


def test_the_ledger_refuses_to_run_under_another_profiler() -> None:
    """torch runs one profiler session at a time: a second would silently end the first."""
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
        pytest.raises(RuntimeError, match="another profiler"),
    ):
        CpuAllocatorLedger().start()


def test_the_cpu_flash_ops_internal_buffer_is_counted() -> None:
    """aten's CPU flash attention allocates a scratch of threads x (q_split x kv_split + 2 x
    q_split + q_split x head_dim) fp32 inside the op (FlashAttentionKernel.cpp; splits 256 and
    512 at 2048 tokens): the peak above the inputs is its out, its lse and that scratch, to
    the byte. A resident-set meter cannot see an op's buffers that reuse pages already
    resident."""
    b, h, s, d = 1, 4, 2048, 32
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash(q, k, v)  # one-time work outside the measurement
    meter = PeakMeter(CPU)
    meter.baseline()
    try:
        meter.reset()
        out, lse = flash(q, k, v)
        peak = meter.peak()
    finally:
        meter.stop()
    scratch = torch.get_num_threads() * (256 * 512 + 2 * 256 + 256 * d) * 4
    assert peak == out.nbytes + lse.nbytes + scratch, (peak, out.nbytes, lse.nbytes, scratch)


class Probe(torch.nn.Module):
    """Each call: 16 fresh 1 MiB tensors one at a time, then a clone of q."""

    def __init__(self) -> None:
        super().__init__()
        self.profiled: list[bool] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False):
        self.profiled.append(_profiling())
        for _ in range(16):
            torch.ones(MIB, dtype=torch.uint8)
        return q.clone()


@pytest.mark.parametrize("warmup", [1, 0])
def test_the_protocol_meters_only_the_first_iteration_then_traces(warmup: int) -> None:
    """workers.protocol's loop: the first iteration (the warm-up, else the first timed one)
    runs under the meter's profiler session and its peak is exact (the input and one 1 MiB
    tensor at a time; q's clone comes after); every later iteration runs without it, and a run's own
    trace (`profile: true`) starts only once the meter has stopped."""
    cfg = RunConfig.model_validate(
        {"kernel": "dense", "seq_len": 64, "num_heads": 1, "head_dim": 8, "device": "cpu",
         "warmup": warmup, "iterations": 3}
    )  # fmt: skip
    entered: list[bool] = []

    @contextlib.contextmanager
    def trace() -> Iterator[None]:
        entered.append(_profiling())
        yield

    meter = PeakMeter(CPU)
    meter.baseline()
    x = torch.randn(1, 64, 1, 8)
    probe = Probe()
    loop = _timed_loop(probe, {"q": x, "k": x, "v": x}, cfg, meter, CPU, trace=trace())
    times, peak = loop.times, loop.peak
    assert len(times) == 3 and len(probe.profiled) == 3 + warmup
    assert probe.profiled == [True] + [False] * (2 + warmup)
    assert peak == x.nbytes + MIB  # the input (made after the baseline), one tensor at a time
    assert entered == [False]
    assert meter.resident_peak() is not None
    assert not _profiling()


def _input_bytes(config: RunConfig) -> int:
    tensors = 4 if config.mode == "train" else 3
    return tensors * config.seq_len * config.num_heads * config.head_dim * 4


KERNELS = [
    ("dense", {}),
    ("dilated", {"segment_lengths": [256, 512], "dilation_rates": [1, 2]}),
    ("block_sparse", {"block_size": 128, "sparsity_ratio": 0.25}),
]


@pytest.mark.parametrize("mode", ["forward", "train"])
@pytest.mark.parametrize(("kernel", "params"), KERNELS)
def test_peak_is_at_least_the_memory_after_inputs_which_is_the_inputs(
    kernel: str, params: dict, mode: str
) -> None:
    """peak >= memory after inputs == the q, k, v (and dout) bytes; the peak holds at least
    the output above them (the resident-set meter read peaks below the inputs: report 3's
    4.04 MiB of inputs and a 2.43 MiB peak). The resident figure is reported beside it."""
    config = RunConfig(
        kernel=kernel, params=params, seq_len=1024, num_heads=2, head_dim=16, mode=mode,
        device="cpu", warmup=1, iterations=1,
    )  # fmt: skip
    case = run_case(config)
    assert case.status == "ok", case.error
    result = case.result
    assert result is not None
    inputs = _input_bytes(config)
    out = config.seq_len * config.num_heads * config.head_dim * 4
    assert result.input_memory_bytes == inputs
    assert result.peak_memory_bytes >= inputs + out, (result.peak_memory_bytes, inputs)
    assert result.resident_peak_bytes is not None and result.resident_peak_bytes >= 0
    assert not _profiling()


REPEAT = r"""
import json, torch
from workers.config import RunConfig
from workers.protocol import run_case
torch.set_num_threads(1)
peaks = {}
sparse = {"block_size": 128, "sparsity_ratio": 0.25}
for kernel, params in (("dense", {}), ("block_sparse", sparse)):
    config = RunConfig(kernel=kernel, params=params, seq_len=4096, num_heads=2, head_dim=32,
                       device="cpu", warmup=1, iterations=1)
    result = run_case(config).result
    peaks[kernel] = [result.input_memory_bytes, result.peak_memory_bytes]
print(json.dumps(peaks))
"""


def test_a_cell_repeats_within_two_percent_across_fresh_processes() -> None:
    """The same cell in 4 fresh processes reads the same peak within 2% (the resident-set
    meter read one plugin cell at 114,688 / 798,720 / 512,000 / 503,808 B), never below the
    inputs."""
    runs = [fresh_json(REPEAT) for _ in range(4)]
    inputs = 3 * 4096 * 2 * 32 * 4
    for kernel in ("dense", "block_sparse"):
        peaks = [run[kernel][1] for run in runs]
        assert all(run[kernel][0] == inputs for run in runs), runs
        assert min(peaks) > inputs, (kernel, peaks)
        assert max(peaks) <= 1.02 * min(peaks), (kernel, peaks)


def test_a_cases_cpu_peak_does_not_depend_on_the_cases_before_it() -> None:
    """A rank runs case after case (a search's probes): a case repeated after longer ones
    reads the same peak (the resident-set meter read block_sparse at 16K up to 6.8 MB over its
    floor after a 32K case)."""
    params = {"block_size": 128, "sparsity_ratio": 0.25}
    peaks: dict[int, list[int]] = {}
    for seq in (2048, 4096, 2048, 4096, 2048):
        config = RunConfig(
            kernel="block_sparse", params=params, seq_len=seq, num_heads=2, head_dim=32,
            device="cpu", warmup=1, iterations=1,
        )  # fmt: skip
        result = run_case(config).result
        assert result is not None
        peaks.setdefault(seq, []).append(result.peak_memory_bytes)
    for seq, repeats in peaks.items():
        assert max(repeats) <= 1.02 * min(repeats), (seq, peaks)


def test_a_profiled_run_meters_the_same_peak_and_still_traces() -> None:
    """`profile: true` runs its own torch.profiler session: it starts after the meter's (torch
    runs one at a time), so the peak is the unprofiled run's and the trace still comes back."""
    base = {"kernel": "dense", "seq_len": 1024, "num_heads": 2, "head_dim": 16, "device": "cpu",
            "warmup": 1, "iterations": 2}  # fmt: skip
    plain = run_case(RunConfig.model_validate(base))
    profiled = run_case(RunConfig.model_validate({**base, "profile": True}))
    assert plain.result is not None and profiled.result is not None
    assert profiled.result.peak_memory_bytes == plain.result.peak_memory_bytes
    (trace,) = profiled.artifacts
    assert trace.name == "trace-rank0.json" and trace.data is not None
    assert b"scaled_dot_product" in trace.data
    assert not _profiling()


def test_a_meter_session_records_allocations_and_no_user_scope_op() -> None:
    """The meter's session records the allocator's events and no USER_SCOPE RecordFunction:
    c10d's Work opens one when a transfer is posted and closes it on gloo's thread when the
    transfer completes, and that close raced with the session (a rank died by SIGSEGV when
    its ring's transfers completed while the session recorded or stopped)."""
    from torch._C._autograd import _disable_profiler

    memory._start_session()
    try:
        with torch.autograd.profiler.record_function("ringlab-user-scope"):  # USER_SCOPE
            kept = torch.ones(1 << 16)
    finally:
        result = _disable_profiler()
    names = [node.name for node in memory._walk(result.experimental_event_tree())]
    assert "ringlab-user-scope" not in names
    sizes = [size for _, size in memory._allocations(result)]
    assert kept.numel() * 4 in sizes  # the allocation inside the scope is still seen
