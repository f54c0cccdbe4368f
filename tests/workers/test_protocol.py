"""The benchmark protocol without Ray: times, honest peak memory, OOM outcomes, correctness gate."""

from __future__ import annotations

import statistics

import pytest
import torch
from _workers_helpers import config

import attention
from attention.dense import DenseAttention
from attention.registry import Exact, KernelSpec
from workers import gate, inputs, kernels, protocol, references

FP32 = 4


def _floor(cfg, tensors: int) -> int:
    return tensors * cfg.batch_size * cfg.seq_len * cfg.num_heads * cfg.head_dim * FP32


def test_times_and_throughput_follow_each_iteration() -> None:
    cfg = config(seq_len=1024, iterations=4)
    case = protocol.run_case(cfg)
    assert case.status == "ok" and case.error is None
    result = case.result
    assert len(result.times_s) == 4 and all(t > 0 for t in result.times_s)
    assert result.median_s == statistics.median(result.times_s)
    assert result.p10_s <= result.median_s <= result.p90_s
    assert result.tokens_per_s == pytest.approx(1024 / result.median_s)
    kernel = attention.build("dense")
    assert result.flops == kernel.flops(1, 1024, 2, 16, False)
    assert result.flops_per_s == pytest.approx(result.flops / result.median_s)
    assert result.backend == "sdpa-flash-cpu"
    assert case.first_iteration_at < case.last_iteration_at
    assert case.environment.torch and case.environment.python


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_peak_memory_is_plausible_for_a_known_allocation(mode: str) -> None:
    cfg = config(seq_len=4096, num_heads=4, head_dim=32, mode=mode, iterations=2)
    # Inputs plus the output (forward); train adds dout and three gradients.
    floor = _floor(cfg, 4 if mode == "forward" else 8)
    peak = protocol.run_case(cfg).result.peak_memory_bytes
    assert 0.9 * floor <= peak <= 3 * floor, (peak, floor)


def test_cpu_budget_over_the_peak_is_an_emulated_oom() -> None:
    cfg = config(seq_len=4096, num_heads=4, head_dim=32)
    budget = _floor(cfg, 3) + _floor(cfg, 1) // 2  # holds the inputs, not the output
    case = protocol.run_case(cfg.model_copy(update={"memory_budget_bytes": budget}))
    assert case.status == "oom" and case.emulated
    assert case.peak_memory_bytes > budget
    assert case.result.emulated_oom and case.result.memory_budget_bytes == budget
    assert f"over the {budget}-byte CPU memory budget" in case.error


def test_inputs_over_the_budget_are_not_allocated() -> None:
    cfg = config(seq_len=4096, num_heads=4, head_dim=32, memory_budget_bytes=1000)
    case = protocol.run_case(cfg)
    assert case.status == "oom" and case.emulated and case.result is None
    assert case.requested_bytes == _floor(cfg, 3)


def test_allocation_failure_is_an_oom_and_the_rank_stays_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed allocation is an oom naming the stage and the bytes asked for, and the rank
    stays usable: in the timed run once the process has primed the case's shape, and in the
    warm-up (the prime at PRIME_MIN_LEN) before it has."""
    monkeypatch.setattr(protocol, "_PRIMED", set())  # this process primed nothing yet
    # 1 TiB per input; ungated, so no correctness check allocates first (the gate's: below)
    huge = config(seq_len=4096, num_heads=65536, head_dim=1024, correctness_check=False)
    case = protocol.run_case(huge)
    assert case.status == "oom" and not case.emulated
    assert case.error.startswith("the warm-up run ran out of memory")
    primed = huge.model_copy(update={"seq_len": protocol.PRIME_MIN_LEN})
    assert case.requested_bytes == _floor(primed, 1)
    assert protocol.run_case(config()).status == "ok"  # primes the shape, as before a sweep
    case = protocol.run_case(huge)
    assert case.status == "oom" and not case.emulated
    assert "can't allocate memory" in case.error
    assert case.requested_bytes == _floor(huge, 1)
    assert protocol.run_case(config()).status == "ok"


def test_allocation_failure_in_the_correctness_check_is_an_oom() -> None:
    """A correctness sweep checks at the full length: running out of memory there is an oom
    outcome naming where, not a failed run, and the rank stays usable."""
    huge = config(seq_len=4096, num_heads=65536, head_dim=1024)  # 1 TiB per input
    case = protocol.run_case(huge, kind="correctness")
    assert case.status == "oom" and not case.emulated
    assert case.error.startswith(
        "the correctness check at seq_len 4096 (every row) ran out of memory"
    )
    assert protocol.run_case(config()).status == "ok"


class _Skewed(DenseAttention):
    """dense plus a constant: fast and wrong, what the correctness gate must stop."""

    def forward(self, q, k, v, *, causal=False):  # type: ignore[no-untyped-def]
        return super().forward(q, k, v, causal=causal) + 0.01


@pytest.fixture
def skewed(monkeypatch: pytest.MonkeyPatch) -> str:
    """`dense` replaced by a wrong kernel that declares dense's exact output (the reference
    is an independent einsum)."""
    spec = KernelSpec(
        name="skewed",
        description="test",
        params=attention.KERNELS["dense"].params,
        factory=_Skewed,
        exact=Exact.DENSE,
    )
    monkeypatch.setitem(attention.KERNELS, "dense", spec)
    return "dense"


def test_correctness_check_fails_a_wrong_kernel(skewed: str) -> None:
    case = protocol.run_case(config(kernel=skewed, correctness_check=True))
    assert case.status == "failed" and case.result is None
    assert "correctness check failed: max abs error 1.0e-02 at 128 (every row)" in case.error


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_correctness_check_passes_dense_and_is_recorded(mode: str) -> None:
    case = protocol.run_case(config(correctness_check=True, mode=mode))
    assert case.status == "ok"
    assert 0 < case.result.max_abs_error <= gate.CHECK_ATOL["float32"]


def test_correctness_kind_checks_at_the_full_length(skewed: str) -> None:
    case = protocol.run_case(config(kernel=skewed, seq_len=256), kind="correctness")
    assert case.status == "failed" and "at 256 (every row)" in case.error


SPARSE = [
    ("dilated", {"segment_lengths": [64, 128], "dilation_rates": [1, 2]}),
    ("dilated", {"segment_lengths": [64, 256], "dilation_rates": [1, 4], "ordering": "hilbert"}),
    ("block_sparse", {"block_size": 16, "pattern": "local_window", "window": 2}),
]


@pytest.mark.parametrize(("kernel", "params"), SPARSE)
def test_sparse_kernels_are_checked_against_their_explicit_masks(kernel: str, params) -> None:
    cfg = config(
        kernel=kernel, params=params, seq_len=256, mode="train", causal=True, correctness_check=True
    )
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    assert 0 < case.result.max_abs_error <= 1e-4


def test_a_kernel_without_a_reference_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every registered kernel has a reference now; one without is refused, alone and as a
    layer's inner kernel. A layer's reference needs its built weights, not just its params."""
    spec = KernelSpec(
        name="_unchecked",
        description="test",
        params=attention.KERNELS["dense"].params,
        factory=DenseAttention,
    )
    monkeypatch.setitem(attention.KERNELS, spec.name, spec)
    refused = "correctness_check: no exact reference for kernel '_unchecked'"
    with pytest.raises(ValueError, match=refused):
        references.check_available("_unchecked", {})
    with pytest.raises(ValueError, match=refused):
        references.check_available("multihead", {"kernel": "_unchecked"})
    references.check_available("multihead", {"kernel": "dilated", "kernel_params": DILATED})
    with pytest.raises(ValueError, match=r"'multihead' is checked with the built layer's weights"):
        references.reference_for("multihead", {})
    assert references.describe("multihead", {}) == (
        "torch.nn.MultiheadAttention with the layer's weights"
    )
    assert references.describe("multihead", {"kernel": "dilated", "kernel_params": DILATED}) == (
        "the layer's projections around dense attention on the explicit masks of 'dilated'"
    )


DILATED = {"segment_lengths": [32, 64], "dilation_rates": [1, 2]}
LAYERS = {
    "dense": {"kernel": "dense"},
    "dense-no-bias": {"kernel": "dense", "bias": False},
    "dilated": {"kernel": "dilated", "kernel_params": DILATED},
}
CPU = torch.device("cpu")


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("mode", ["forward", "train"])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_runs_as_a_layer_and_passes_the_gate(layer: str, mode: str, causal: bool) -> None:
    """A multihead cell runs on (batch, seq, num_heads x head_dim) inputs; its check compares
    output (and dq, dk, dv) with nn.MultiheadAttention (dense) or explicit projections around
    the inner kernel's reference; its FLOPs are the layer's own count, projections included."""
    params = LAYERS[layer]
    cfg = config(
        kernel="multihead",
        params=params,
        seq_len=256,
        mode=mode,
        causal=causal,
        correctness_check=True,
    )
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    result = case.result
    assert 0 < result.max_abs_error <= gate.CHECK_ATOL["float32"]
    assert result.check_seq_len == 128
    train = mode == "train"
    module = attention.build("multihead", **params, embed_dim=32, num_heads=2)
    assert result.flops == module.flops(1, 256, 2, 16, causal, backward=train)
    inner = attention.build(params["kernel"], **params.get("kernel_params", {}))
    projections = 4 * 2 * 256 * 32 * 32 * (3 if train else 1)
    assert result.flops == projections + inner.flops(1, 256, 2, 16, causal, backward=train)


def test_layer_inputs_are_the_heads_inputs_flattened() -> None:
    """Same seeded values as a (batch, seq, heads, dim) cell, seen as (batch, seq, embed_dim)."""
    heads = config(seq_len=256, batch_size=2)
    layer = config(kernel="multihead", seq_len=256, batch_size=2)
    positions = torch.arange(256)
    for name in ("q", "dout"):
        want = inputs.make_input(name, heads, 256, positions, slice(None), CPU)
        got = inputs.make_input(name, layer, 256, positions, slice(None), CPU)
        assert got.shape == (2, 256, 32)
        assert torch.equal(got, want.flatten(2))


def test_layer_weights_are_seeded_by_the_config() -> None:
    """Every build of a cell (every rank, the check, the timed run) gets the same weights, from
    config.seed; the caller's random state is untouched."""
    cfg = config(kernel="multihead", seq_len=256)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, second = kernels.build(cfg, CPU), kernels.build(cfg, CPU)
    assert torch.equal(torch.get_rng_state(), state)
    pairs = zip(first.parameters(), second.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    other = kernels.build(cfg.model_copy(update={"seed": 1}), CPU)
    assert not torch.equal(first.q_proj.weight, other.q_proj.weight)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_the_layer_gate_sees_a_changed_weight(layer: str) -> None:
    """The reference holds its own copy of the weights: a layer whose out_proj weight is
    transposed after the reference was taken fails by far, so the gate is not vacuous."""
    cfg = config(kernel="multihead", params=LAYERS[layer], seq_len=128, mode="train", causal=True)
    module = kernels.build(cfg, CPU)
    reference = references.layer_reference(module)
    assert gate.max_error(cfg, module, reference, 0, CPU) <= gate.CHECK_ATOL["float32"]
    with torch.no_grad():
        module.out_proj.weight.copy_(module.out_proj.weight.T.clone())
    error = gate.max_error(cfg, module, reference, 0, CPU)
    assert error > 1000 * gate.CHECK_ATOL["float32"], error


def test_shorter_length_is_the_smallest_valid_divisor() -> None:
    assert inputs.shorter_length(config(seq_len=1 << 20), 128) == 128
    assert inputs.shorter_length(config(seq_len=100), 128) == 100
    hilbert = config(
        kernel="dilated",
        params={"segment_lengths": [2048, 4096], "dilation_rates": [1, 2], "ordering": "hilbert"},
        seq_len=1 << 14,
    )
    assert inputs.shorter_length(hilbert, 128) == 256  # the smallest power of 4 >= 128 dividing it
    ring = config(kernel="ring", world_size=4, seq_len=3000, params={"layout": "contiguous"})
    assert inputs.shorter_length(ring, 128) == 200


RING_HILBERT = [
    (
        "ring_dilated",
        {"segment_lengths": [64, 256], "dilation_rates": [1, 4], "ordering": "hilbert"},
    ),
    (
        "ring_block_sparse",
        {"block_size": 16, "pattern": "local_window", "window": 2, "ordering": "hilbert"},
    ),
]


def rank_checked_case(rank: int, world: int, kernel: str, params: dict) -> tuple[str, float]:
    cfg = config(
        kernel=kernel,
        params=params,
        seq_len=256,
        world_size=world,
        mode="train",
        causal=True,
        correctness_check=True,
    )
    case = protocol.run_case(cfg, rank)
    assert case.status == "ok", case.error
    return case.status, case.result.max_abs_error


@pytest.mark.parametrize(("kernel", "params"), RING_HILBERT)
def test_ring_kernels_in_hilbert_order_pass_the_correctness_gate(kernel: str, params) -> None:
    """Each rank holds its shard of the Hilbert-ordered sequence (the module's own
    local_positions), so the ring matches its twin's reference, output and gradients."""
    from _dist_helpers import run_ranks

    for status, error in run_ranks(rank_checked_case, 2, kernel, params):
        assert status == "ok" and 0 < error <= 1e-4
