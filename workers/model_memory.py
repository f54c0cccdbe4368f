"""Memory of a `workload: model` cell predicted before it runs: a pure function of the cell.

Per rank, by component (bytes):
- parameters: the exact count of the model built on the meta device x bytes per weight
  (2 for pure bf16, else 4: autocast keeps fp32 weights);
- gradients: the same bytes (gradients take their parameter's dtype);
- optimizer_states: adamw two moments like each parameter plus a 4-byte step per tensor; sgd
  one momentum buffer; adamw8bit (bitsandbytes) one byte per moment per element with a fp32
  absmax per 256-element block, 32-bit moments for tensors under 4096 elements;
- activations: what the forward keeps for backward, tensor by tensor (`block_saved`), the
  attention kernel's own share from its `memory_model()`, autocast's low-precision weight
  copies included (the graph keeps them);
- forward_transient: the largest extra the forward allocates above the kept activations (the
  logits and their fp32 copy, or one loss chunk's);
- backward_peak: the peak of the backward above what is held before the forward;
- step_peak: the whole step's peak above the pre-model baseline, the number a memory budget
  is held against; `max_seq_len` solves step_peak(L) <= budget.

Every saved tensor of workers/model.py is named here; tests/workers/test_model_memory.py counts them
with saved-tensor hooks and holds the two to each other.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

import attention
from attention.base import Kernel, KernelMemory
from workers import kernels
from workers.config import ModelConfig, RunConfig, TrainingConfig
from workers.model import Decoder, checkpointed_blocks

COMPONENTS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "forward_transient",
    "backward_peak",
    "step_peak",
    "allocator_overhead",
)
"""The components stored per rank (allocator_overhead is measured on CUDA only)."""


@dataclass(frozen=True)
class Widths:
    """Bytes per element of a precision: weights, matmul activations, the residual stream."""

    weight: int
    compute: int
    residual: int


def widths(training: TrainingConfig) -> Widths:
    """fp32: all 4; autocast: fp32 weights and residual stream, 2-byte matmul outputs; pure
    bf16: all 2."""
    if training.precision == "fp32":
        return Widths(4, 4, 4)
    if training.precision == "bf16":
        return Widths(2, 2, 2)
    return Widths(4, 2, 4)


def _autocast(training: TrainingConfig) -> bool:
    return training.precision.endswith("_autocast")


@functools.lru_cache(maxsize=256)
def parameter_counts(model: ModelConfig, training: TrainingConfig) -> tuple[int, int, int]:
    """(parameters, parameter tensors, elements of linear weights autocast copies) of the
    model built on the meta device: exact, whatever the shape, without allocating it."""
    with torch.device("meta"):
        net = Decoder(model, training, lambda: torch.nn.Identity())
    params = list(net.parameters())  # a tied weight once
    linear = sum(
        m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear)
    )  # the tied head's weight too: autocast casts it for the head matmul
    return sum(p.numel() for p in params), len(params), linear


def optimizer_bytes(model: ModelConfig, training: TrainingConfig) -> int:
    """The optimizer's state after its first step."""
    w = widths(training).weight
    n, tensors, _ = parameter_counts(model, training)
    if training.optimizer == "adamw":
        return 2 * n * w + 4 * tensors
    if training.optimizer == "sgd":
        return n * w
    with torch.device("meta"):
        net = Decoder(model, training, lambda: torch.nn.Identity())
    total = 0
    for p in net.parameters():
        if p.numel() < 4096:
            total += 2 * 4 * p.numel()
        else:
            total += 2 * (p.numel() + 4 * -(-p.numel() // 256))
    return total


def _kernel_memory(config: RunConfig, tokens_local: int) -> KernelMemory:
    """The kernel's memory_model at this rank's shard (NotImplementedError if it has none)."""
    assert config.model is not None
    module = attention.build(config.kernel, **kernels.kernel_params(config))
    if not isinstance(module, Kernel):
        raise NotImplementedError(f"kernel {config.kernel!r} has no memory model")
    if kernels.is_distributed(config.kernel):  # no process group yet: the run's ranks
        module.world_size = kernels.shard_world(config)  # type: ignore[attr-defined]
    if hasattr(module, "causal"):  # allgather_kv: causal blocks span fewer keys
        module.causal = config.causal
    return module.memory_model(
        config.local_batch,
        tokens_local // config.local_batch,
        config.model.n_heads,
        config.model.head_dim,
        widths(config.training or TrainingConfig()).compute,
    )


@dataclass(frozen=True)
class Prediction:
    """Predicted bytes per component for one rank at one total length (see the module doc)."""

    seq_len: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    forward_transient: int
    backward_peak: int
    step_peak: int

    def components(self) -> dict[str, int | None]:
        """Every component of COMPONENTS (allocator_overhead is not predicted: None)."""
        out: dict[str, int | None] = {k: v for k, v in asdict(self).items() if k != "seq_len"}
        out["allocator_overhead"] = None
        return out


@dataclass(frozen=True)
class _Blocks:
    """What the forward keeps per decoder block at `t` tokens on this rank (bytes)."""

    t: int
    attention_saved: int
    """The attention sublayer's saved tensors: its projection's input, the kernel's, the output."""
    mlp_saved: int
    norm: int
    """One LayerNorm's: its input, its mean and rstd."""
    block_input: int
    full_block: int
    """A block that is not recomputed: two norms, attention and MLP."""
    recompute: list[bool]
    per_block: list[int]
    """What each block keeps under the checkpointing policy (a recomputed one its input only)."""


def _blocks(model: ModelConfig, training: TrainingConfig, km: KernelMemory, t: int) -> _Blocks:
    """The per-block saved tensors of `model` under `training`'s precision and checkpointing."""
    d, c, r = model.d_model, widths(training).compute, widths(training).residual
    heads_dim = model.n_heads * model.head_dim
    attention_saved = (
        t * d * c  # the q/k/v projection's input (autocast: its low-precision copy)
        + km.saved
        + (0 if km.output_saved else t * heads_dim * c)
    )
    mlp_saved = t * d * c + 2 * t * model.ffn_dim * c  # fc1's input, GELU's input, fc2's input
    norm = t * d * r + t * 2 * r  # each LayerNorm keeps its input, its mean and rstd
    full_block = norm + attention_saved + norm + mlp_saved
    block_input = t * d * r
    recompute = checkpointed_blocks(training, model.n_layers)
    per_block = []
    for whole in recompute:
        if whole:
            per_block.append(block_input)
        elif training.checkpointing == "attention":
            per_block.append(block_input + norm + mlp_saved)
        else:
            per_block.append(full_block)
    return _Blocks(
        t, attention_saved, mlp_saved, norm, block_input, full_block, recompute, per_block
    )


def _weight_copies(
    model: ModelConfig, training: TrainingConfig, linear: int, recompute: list[bool]
) -> int:
    """Autocast's low-precision copies of the linear weights the graph keeps (0 without
    autocast): those of the blocks not recomputed, and the head's when the loss is unchunked."""
    if not _autocast(training):
        return 0
    d, v = model.d_model, model.vocab_size
    n_recomputed = sum(recompute) if training.checkpointing != "attention" else 0
    block_linear = (linear - v * d) // model.n_layers
    kept_blocks = model.n_layers - n_recomputed
    if training.checkpointing == "attention":  # the attention projections are recomputed
        block_linear -= d * (model.n_heads + 2 * model.kv_heads) * model.head_dim
        block_linear -= model.n_heads * model.head_dim * d
    weight_copies = 2 * (block_linear * kept_blocks)
    if training.loss_chunk_tokens is None:
        weight_copies += 2 * v * d  # the head's copy (chunks recompute theirs)
    return weight_copies


@dataclass(frozen=True)
class _Head:
    """The final norm, LM head and loss: what they keep and how many tokens' logits at once."""

    saved: int
    """The final norm's tensors and the head's input."""
    loss_saved: int
    """log_softmax's fp32 output (unchunked only: a chunk drops its own)."""
    logit_tokens: int


def _head(model: ModelConfig, training: TrainingConfig, t: int) -> _Head:
    """What the final norm, the head and the loss keep at `t` tokens (chunked or not)."""
    d, v = model.d_model, model.vocab_size
    c, r = widths(training).compute, widths(training).residual
    final_norm = t * d * r + t * 2 * r
    chunk = training.loss_chunk_tokens
    if chunk is None:
        head_saved = t * d * c  # the head's input: the norm output (autocast: its copy)
        return _Head(final_norm + head_saved, 4 * t * v, t)  # log_softmax's fp32 output
    head_saved = t * d * r  # the final norm's output: every chunk's input
    return _Head(final_norm + head_saved, 0, min(chunk, t))


@dataclass(frozen=True)
class _Step:
    """What one rank's training step holds at one length, for its forward and backward peaks."""

    model: ModelConfig
    training: TrainingConfig
    km: KernelMemory
    blocks: _Blocks
    head: _Head
    below: int
    """Kept from the first block's forward to the end: autocast's weight copies, rotary's tables."""
    activations: int


def _forward_transient(step: _Step) -> int:
    """The largest extra the forward allocates above the activations it keeps.

    Block by block, what a block holds while it runs above what it keeps: the q/k/v
    projection output (until q, k, v are copied out of it) plus rotary's temporaries; the
    kernel's own; autocast's fp32 norm output before its low-precision copy. Then the head.
    """
    model, training, km, blocks = step.model, step.training, step.km, step.blocks
    below, activations, head = step.below, step.activations, step.head
    t, d, f, v = blocks.t, model.d_model, model.ffn_dim, model.vocab_size
    c = widths(training).compute
    qkv_out = t * (model.n_heads + 2 * model.kv_heads) * model.head_dim * c
    rope_tmp = t * model.n_heads * model.head_dim * c
    ln_tmp = t * d * 4 if _autocast(training) else 0
    block_fwd = max(qkv_out + rope_tmp, km.forward_transient, ln_tmp)
    forward_peak = 0
    kept = below
    for whole, held in zip(blocks.recompute, blocks.per_block, strict=True):
        if whole:  # a checkpointed forward saves nothing: only its running temporaries
            extra = max(block_fwd, 2 * t * f * c)
        elif training.checkpointing == "attention":
            extra = max(block_fwd, held - blocks.block_input)
        else:
            extra = held - blocks.block_input + block_fwd
        forward_peak = max(forward_peak, kept + blocks.block_input + extra)
        kept += held
    # then the head: the logits, their fp32 copy (when not fp32) and log_softmax's output
    # (unchunked it stays: it is in the activations; a chunk's is dropped with the chunk)
    logits = head.logit_tokens * v * (c + (4 if c != 4 else 0) + 4)
    forward_peak = max(forward_peak, activations - head.loss_saved + logits)
    return max(0, forward_peak - activations)


def _backward_peak(step: _Step) -> int:
    """The peak of the backward above what is held before the forward.

    First the loss's fp32 gradient twice (log_softmax's backward; a chunk recomputes its
    log_softmax output first); then block by block, last first: the blocks below keep their
    tensors, the gradients of the blocks above exist, and the block holds its MLP's or its
    attention's backward working set (a recomputed block its recomputed tensors too); last
    the embedding's dense gradient.
    """
    model, training, km, blocks = step.model, step.training, step.km, step.blocks
    below, activations, head = step.below, step.activations, step.head
    t, d, v, lt = blocks.t, model.d_model, model.vocab_size, head.logit_tokens
    wd = widths(training)
    c, r = wd.compute, wd.residual
    grads = parameter_counts(model, training)[0] * wd.weight
    head_grad = v * d * wd.weight
    untied = 0 if model.tied_embeddings else v * d * wd.weight
    block_grads = (grads - untied - head_grad) // model.n_layers
    chunked = training.loss_chunk_tokens is not None
    head_transient = 8 * lt * v + (4 * lt * v if chunked else 0)
    # unchunked, the head's weight gradient comes once the loss's buffers are freed; chunked,
    # it exists from the first chunk on
    at_top = activations + head_transient + (head_grad if chunked else 0)
    grad_in = t * d * r
    mlp_bwd = 2 * t * model.ffn_dim * c + grad_in
    attn_bwd = km.backward_transient + grad_in + t * model.n_heads * model.head_dim * c
    attention_part = t * 2 * r + blocks.attention_saved  # what recomputing attention makes
    mlp_part = t * 2 * r + t * d * r + blocks.mlp_saved  # norm2 (input, stats) and the MLP's
    backward_peak = at_top
    for k in reversed(range(model.n_layers)):
        below_k = below + sum(blocks.per_block[:k])
        grads_k = head_grad + untied + (model.n_layers - k) * block_grads
        if blocks.recompute[k]:  # recomputed whole, then its MLP and its attention run backward
            inside = max(
                blocks.full_block - blocks.block_input + mlp_bwd, attention_part + attn_bwd
            )
        elif training.checkpointing == "attention":
            inside = max(mlp_part + mlp_bwd, attention_part + attn_bwd)
        else:
            inside = max(
                blocks.full_block - blocks.block_input + mlp_bwd, attention_part + attn_bwd
            )
        backward_peak = max(backward_peak, below_k + blocks.block_input + inside + grads_k)
    return max(backward_peak, grads + v * d * wd.weight)


def predict(config: RunConfig, seq_len: int | None = None) -> Prediction:
    """Predicted memory of one rank of this model cell at `seq_len` (default its own).

    Raises NotImplementedError when the kernel has no memory_model(), ValueError for an
    attention-only cell.
    """
    if config.model is None or config.training is None:
        raise ValueError("workload: only a model cell has a model memory prediction")
    model, training = config.model, config.training
    length = config.seq_len if seq_len is None else seq_len
    at = config if length == config.seq_len else config.model_copy(update={"seq_len": length})
    t = at.local_batch * at.local_seq_len
    n_params, _, linear = parameter_counts(model, training)
    params = n_params * widths(training).weight
    optim = optimizer_bytes(model, training)
    km = _kernel_memory(at, t)
    blocks = _blocks(model, training, km, t)
    head = _head(model, training, t)
    rotary = at.local_seq_len * model.head_dim * widths(training).compute  # cos, sin: shared
    # kept from the first block's forward to the end
    below = _weight_copies(model, training, linear, blocks.recompute) + rotary
    activations = sum(blocks.per_block) + below + head.saved + head.loss_saved
    step = _Step(model, training, km, blocks, head, below, activations)
    forward_transient = _forward_transient(step)
    backward_peak = _backward_peak(step)
    step_peak = params + optim + max(activations + forward_transient, backward_peak)
    return Prediction(
        seq_len=length,
        parameters=params,
        gradients=params,  # gradients take their parameter's dtype
        optimizer_states=optim,
        activations=activations,
        forward_transient=forward_transient,
        backward_peak=backward_peak,
        step_peak=step_peak + input_bytes(at),
    )


def input_bytes(config: RunConfig) -> int:
    """The rank's token ids, targets and positions (int64 each)."""
    return 3 * 8 * config.local_batch * config.local_seq_len


def max_seq_len(config: RunConfig, budget: int) -> int | None:
    """The longest total length whose predicted step_peak fits `budget` bytes (None when not
    even one token per rank does); a power-of-two search then bisection on the length."""
    world = config.world_size if config.parallel == "sequence" else 1
    lo, hi = 0, world
    while predict(config, hi).step_peak <= budget:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > world:
        mid = (lo + hi) // 2 // world * world
        if mid <= lo:
            break
        if predict(config, mid).step_peak <= budget:
            lo = mid
        else:
            hi = mid
    return lo or None
