"""The model memory prediction (workers/model_memory.py) held to the real decoder, tensor by tensor.

Every number predicted here is checked against bytes counted on the real modules: the tensors
autograd saves (saved-tensor hooks), the storages still alive after the forward (a dispatch mode
holding a weak reference to every storage an op returns: checkpointed regions included), the
parameters, gradients and optimizer states of a real step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dist_helpers import single_thread
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import attention
from workers import model_memory
from workers.config import RunConfig
from workers.model import Decoder
from workers.training import AUTOCAST_DTYPES, _Trainer, build_model, rank_tokens, state_bytes

CPU = torch.device("cpu")
DILATED = {"segment_lengths": [64, 128], "dilation_rates": [1, 2]}
BLOCK_SPARSE = {"block_size": 32, "pattern": "local_window", "window": 2}
KERNELS = [("dense", {}), ("dilated", DILATED), ("block_sparse", BLOCK_SPARSE)]
PRECISIONS = ["fp32", "bf16_autocast", "bf16"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread for every test here (what is counted does not depend on it)."""
    with single_thread():
        yield


def model_cell(
    kernel: str = "dense",
    params: dict[str, Any] | None = None,
    seq_len: int = 256,
    batch_size: int = 1,
    training: dict[str, Any] | None = None,
    **model: Any,
) -> RunConfig:
    """A small CPU model cell: d_model 64, 2 layers, 4 heads, vocab 512 unless overridden."""
    return RunConfig.model_validate(
        {
            "workload": "model",
            "kernel": kernel,
            "params": params or {},
            "seq_len": seq_len,
            "batch_size": batch_size,
            "device": "cpu",
            "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512, **model},
            "training": training or {},
        }
    )


def _inputs(config: RunConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    positions = torch.arange(config.seq_len)
    tokens, targets = rank_tokens(config, positions, 0, CPU)
    return tokens, targets, positions


def _autocast(config: RunConfig) -> contextlib.AbstractContextManager[Any]:
    assert config.training is not None
    dtype = AUTOCAST_DTYPES.get(config.training.precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def _excluded(net: torch.nn.Module, *tensors: torch.Tensor) -> set[int]:
    """Storages that are not activations: the parameters and the token/target/position inputs."""
    return {t.untyped_storage().data_ptr() for t in [*net.parameters(), *tensors]}


def saved_bytes(config: RunConfig) -> int:
    """Bytes of the distinct storages the loss forward saves for backward (hooks), parameters
    and inputs excluded."""
    net = build_model(config, CPU)
    tokens, targets, positions = _inputs(config)
    excluded = _excluded(net, tokens, targets, positions)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(config):
        loss = net.loss(tokens, targets, positions, config.seq_len)
    assert torch.isfinite(loss)
    return sum(seen.values())


class _LiveStorages(TorchDispatchMode):
    """Remembers every storage any op returns, by weak reference: after the forward, the ones
    still alive are what the graph (and checkpoint frames) keep for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs[storage._cdata] = (
                    StorageWeakRef(storage),
                    storage.data_ptr(),
                    storage.nbytes(),
                )
        return out

    def alive(self, excluded: set[int]) -> int:
        return sum(
            nbytes
            for ref, ptr, nbytes in self.refs.values()
            if not ref.expired() and ptr not in excluded
        )


def kept_bytes(config: RunConfig) -> int:
    """Bytes of the storages the loss forward leaves alive (parameters and inputs excluded):
    measured, whatever keeps them (autograd nodes, checkpoint frames, autocast copies)."""
    net = build_model(config, CPU)
    tokens, targets, positions = _inputs(config)
    excluded = _excluded(net, tokens, targets, positions)
    mode = _LiveStorages()
    with mode, _autocast(config):
        loss = net.loss(tokens, targets, positions, config.seq_len)
    kept = mode.alive(excluded)
    assert torch.isfinite(loss)
    return kept


# --- activations ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 96])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("kernel", "params"), KERNELS, ids=[k for k, _ in KERNELS])
def test_saved_tensors_equal_predicted_activations(kernel, params, precision, chunk) -> None:
    """No checkpointing: the hooks see every saved tensor; they add up to the prediction (the
    loss's 0-d scalars aside)."""
    training = {"precision": precision, "loss_chunk_tokens": chunk}
    config = model_cell(kernel, params, seq_len=256, training=training)
    predicted = model_memory.predict(config).activations
    saved = saved_bytes(config)
    assert saved == pytest.approx(predicted, rel=0.01)
    assert abs(saved - predicted) <= 16  # exact today, up to the loss's 0-d scalars


def test_saved_tensors_with_gqa_untied_batch_and_odd_chunks() -> None:
    """Grouped-query attention (k, v repeated), an untied head, batch 2, a non-integer MLP
    multiplier and a chunk size that does not divide the tokens."""
    for precision in PRECISIONS:
        config = model_cell(
            "dense",
            seq_len=256,
            batch_size=2,
            training={"precision": precision, "loss_chunk_tokens": 100},
            d_model=48,
            num_kv_heads=2,
            vocab_size=300,
            tied_embeddings=False,
            ffn_multiplier=2.5,
        )
        predicted = model_memory.predict(config).activations
        assert saved_bytes(config) == pytest.approx(predicted, rel=0.01), precision


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "checkpointing",
    [{"checkpointing": c} for c in ("none", "blocks", "attention")]
    + [{"checkpointing": "every_k", "checkpoint_every": 2}],
    ids=["none", "blocks", "attention", "every_k"],
)
def test_live_storages_after_forward_equal_predicted_activations(checkpointing, precision) -> None:
    """Under every checkpointing policy (3 layers: every_k 2 recomputes blocks 0 and 2), what
    the forward leaves alive equals the predicted activations, with and without chunked loss."""
    for kernel, params in (KERNELS[0], KERNELS[1]):
        for chunk in (None, 128):
            training = {"precision": precision, "loss_chunk_tokens": chunk, **checkpointing}
            config = model_cell(kernel, params, seq_len=256, training=training, n_layers=3)
            predicted = model_memory.predict(config).activations
            kept = kept_bytes(config)
            assert kept == pytest.approx(predicted, rel=0.01), (kernel, chunk)


def test_checkpointing_orders_the_predicted_activations() -> None:
    """blocks keeps least, then every_k, then attention, then none; and checkpointing only
    moves activations: parameters and optimizer states are the same."""
    policies = [
        {"checkpointing": "blocks"},
        {"checkpointing": "every_k", "checkpoint_every": 2},
        {"checkpointing": "attention"},
        {"checkpointing": "none"},
    ]
    predictions = [
        model_memory.predict(model_cell(seq_len=1024, training=p, n_layers=4)) for p in policies
    ]
    activations = [p.activations for p in predictions]
    assert activations == sorted(activations) and len(set(activations)) == 4
    assert len({(p.parameters, p.optimizer_states) for p in predictions}) == 1


def test_chunked_loss_predicts_less_for_a_large_vocabulary() -> None:
    """The (tokens x vocab) logits are what chunking removes: less kept and a smaller forward
    transient, and the live storages agree."""
    whole = model_cell(seq_len=256, vocab_size=4096)
    chunked = model_cell(seq_len=256, vocab_size=4096, training={"loss_chunk_tokens": 64})
    p_whole, p_chunked = model_memory.predict(whole), model_memory.predict(chunked)
    assert p_chunked.activations < p_whole.activations
    assert p_chunked.forward_transient < p_whole.forward_transient
    saved = p_whole.activations - p_chunked.activations
    assert kept_bytes(whole) - kept_bytes(chunked) == pytest.approx(saved, rel=0.01)


# --- parameters, gradients, optimizer states ------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tied", [True, False])
def test_parameters_and_gradients_are_counted_exactly(tied: bool, precision: str) -> None:
    config = model_cell(
        seq_len=128,
        training={"precision": precision},
        tied_embeddings=tied,
        num_kv_heads=2,
        ffn_multiplier=3.0,
    )
    trainer = _Trainer(config, 0, CPU)
    params = list(trainer.net.parameters())
    real = sum(p.numel() * p.element_size() for p in params)
    predicted = model_memory.predict(config)
    assert predicted.parameters == real
    # GQA: the fused q/k/v projection has (n_heads + 2 kv heads) x head_dim outputs
    assert trainer.net.blocks[0].attn.qkv.weight.shape == (8 * 16, 64)
    trainer.backward(trainer.forward())
    grads = sum(p.grad.untyped_storage().nbytes() for p in params)
    assert predicted.gradients == grads
    width = 2 if precision == "bf16" else 4
    assert real % width == 0
    # embedding (+ untied head), 6 per block (2 norms, qkv, proj, fc1, fc2), the final norm
    assert len(params) == (2 if tied else 3) + 6 * config.model.n_layers


def test_tied_head_is_one_parameter_and_untied_adds_the_vocab_matrix() -> None:
    tied = model_memory.predict(model_cell(vocab_size=1000))
    untied = model_memory.predict(model_cell(vocab_size=1000, tied_embeddings=False))
    assert untied.parameters - tied.parameters == 1000 * 64 * 4


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizer_states_after_one_real_step(optimizer: str, precision: str) -> None:
    config = model_cell(
        seq_len=128, training={"optimizer": optimizer, "precision": precision}, num_kv_heads=2
    )
    trainer = _Trainer(config, 0, CPU)
    assert state_bytes(trainer.optimizer) == 0
    trainer.backward(trainer.forward())
    trainer.step()
    measured = state_bytes(trainer.optimizer)
    assert model_memory.predict(config).optimizer_states == measured
    n = sum(p.numel() for p in trainer.net.parameters())
    width = 2 if precision == "bf16" else 4
    assert measured == (
        2 * n * width + 4 * len(trainer.optimizer.state) if optimizer == "adamw" else n * width
    )


# --- maximum length -------------------------------------------------------------------------


def test_max_seq_len_fits_the_budget_exactly_and_grows_with_it() -> None:
    config = model_cell(seq_len=1024, vocab_size=2048)
    answers = []
    for budget in (8 << 20, 16 << 20, 32 << 20, 48 << 20, 128 << 20):
        length = model_memory.max_seq_len(config, budget)
        assert length is not None
        assert model_memory.predict(config, length).step_peak <= budget
        assert model_memory.predict(config, length + 1).step_peak > budget
        answers.append(length)
    assert answers == sorted(answers) and len(set(answers)) == len(answers)
    # below what even one token needs (the parameters and optimizer states alone): None
    fixed = model_memory.predict(config, 1)
    assert model_memory.max_seq_len(config, fixed.parameters + fixed.optimizer_states) is None


def test_max_seq_len_steps_by_the_world_size_for_a_sharded_cell() -> None:
    config = model_cell(seq_len=1024, vocab_size=2048, batch_size=2)
    data = RunConfig.model_validate(
        {
            **config.model_dump(exclude={"num_heads", "head_dim"}),
            "world_size": 2,
            "parallel": "data",
        }
    )
    budget = 32 << 20
    length = model_memory.max_seq_len(data, budget)
    assert length is not None
    assert model_memory.predict(data, length).step_peak <= budget
    assert model_memory.predict(data, length + 1).step_peak > budget
    # data parallel: each rank holds one row of two, so longer sequences fit than one rank with both
    assert length > model_memory.max_seq_len(config, budget)


def test_step_peak_grows_with_length() -> None:
    config = model_cell(seq_len=1024, vocab_size=2048)
    peaks = [model_memory.predict(config, n).step_peak for n in (256, 512, 1024, 2048)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4


# --- kernels alone ----------------------------------------------------------------------------

KERNEL_CASES = [
    *KERNELS,
    ("dilated", {**DILATED, "ordering": "hilbert"}),
    ("block_sparse", {**BLOCK_SPARSE, "ordering": "hilbert"}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kernel", "params"),
    KERNEL_CASES,
    ids=["dense", "dilated", "block_sparse", "dilated-hilbert", "block_sparse-hilbert"],
)
def test_kernel_memory_model_equals_saved_storages(kernel, params, dtype) -> None:
    """KernelMemory.saved is the bytes a real forward of the kernel alone saves, q, k, v
    included; output_saved says whether the returned output is one of them."""
    batch, seq, heads, dim = 2, 256, 4, 16
    module = attention.build(kernel, **params)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).requires_grad_()
        for _ in range(3)
    )
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(q, k, v, causal=True)
    memory = module.memory_model(batch, seq, heads, dim, dtype.itemsize)
    if params.get("ordering") == "hilbert":
        # Indexing by the Hilbert permutation and its inverse saves the two int64 index
        # vectors, which memory_model() leaves out today (16 bytes a token, ~1% here).
        assert 0 <= sum(seen.values()) - memory.saved <= 2 * 8 * seq
    else:
        assert sum(seen.values()) == memory.saved
    assert (out.untyped_storage().data_ptr() in seen) == memory.output_saved
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_kernel_memory_scales_with_the_shape() -> None:
    """Twice the tokens, twice the saved bytes; half the element width, less than half
    (the fp32 log-sum-exp stays)."""
    for kernel, params in KERNELS:
        module = attention.build(kernel, **params)
        base = module.memory_model(1, 256, 4, 16, 4)
        assert module.memory_model(1, 512, 4, 16, 4).saved == 2 * base.saved
        assert module.memory_model(2, 256, 4, 16, 4).saved == 2 * base.saved
        assert base.saved / 2 < module.memory_model(1, 256, 4, 16, 2).saved < base.saved


def test_parameter_counts_build_nothing_real() -> None:
    """parameter_counts builds on the meta device: a model far too big for this machine."""
    big = model_cell(seq_len=1024, d_model=8192, n_layers=64, n_heads=64, vocab_size=50304)
    n, tensors, _ = model_memory.parameter_counts(big.model, big.training)
    with torch.device("meta"):
        net = Decoder(big.model, big.training, lambda: torch.nn.Identity())
    assert n == sum(p.numel() for p in net.parameters()) and n > 50_000_000_000
    assert tensors == 2 + 6 * 64


@pytest.mark.parametrize(
    ("kernel", "params", "seq"),
    [
        ("dilated", {"segment_lengths": [64], "dilation_rates": [2]}, 1000),
        ("block_sparse", {"block_size": 256, "pattern": "local_window", "window": 1}, 512),
        ("block_sparse", {"block_size": 256, "pattern": "local_window", "window": 1}, 1000),
    ],
)
def test_the_bf16_forward_transient_counts_the_largest_window_the_forward_fills(
    kernel, params, seq, monkeypatch
) -> None:
    """memory_model's bf16 forward transient is one call's block output (fp32 and bf16) plus
    the fp32 rows of the largest accumulator window the forward really fills (block_sparse:
    whole blocks, so 2 windows of 256 tokens at 512, not 8 of 64)."""
    from attention import primitive

    module = attention.build(kernel, **params)
    filled: list[int] = []
    real = primitive.windowed_result

    def spy(q, fill, spans):
        def counting(c0, c1, out, lse):
            filled.append(c1 - c0)
            fill(c0, c1, out, lse)

        return real(q, counting, spans)

    monkeypatch.setattr(primitive, "windowed_result", spy)
    heads, dim = 2, 8
    module(*(torch.randn(1, seq, heads, dim, dtype=torch.bfloat16) for _ in range(3)))
    call_rows = min(seq, module.chunk_tokens) * heads * dim
    memory = module.memory_model(1, seq, heads, dim, 2)
    assert memory.forward_transient == call_rows * (4 + 2) + max(filled) * heads * dim * 4
    assert len(filled) > 1
