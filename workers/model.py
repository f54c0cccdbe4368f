"""The `workload: model` decoder: a GPT-style stack around any registered attention kernel.

Pre-norm blocks (LayerNorm without bias, attention, LayerNorm, GELU MLP), rotary positions
computed from each token's global position (no learned position table, so a rank holding a
shard of a ring knows where its tokens sit), grouped-query attention by repeating key/value
heads, and an LM head tied to the embedding or not.

Every tensor the blocks save for backward is enumerated in workers/model_memory.py; keep the
two in step (tests/workers/test_model_memory.py counts the saved tensors of this module against it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workers.config import PRECISION_DTYPES, ModelConfig, TrainingConfig
from workers.kernels import DTYPES

ROPE_BASE = 10_000.0


def rotary_tables(
    positions: torch.Tensor, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (S, 1, head_dim/2) for these global positions, in `dtype`."""
    half = head_dim // 2
    inv = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (B, S, H, D) x (the two halves rotated as one complex number).

    Multiplying by the constant tables saves only the tables for backward, not x.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Fused q/k/v projection, rotary q and k, key/value heads repeated for grouped queries,
    the run's kernel (causal), output projection."""

    def __init__(self, cfg: ModelConfig, kernel: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        self.qkv = nn.Linear(d, (cfg.n_heads + 2 * cfg.kv_heads) * hd, bias=False)
        self.proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        hd, h, kv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
        q, k, v = self.qkv(x).split([h * hd, kv * hd, kv * hd], dim=-1)
        q = rotate(q.view(b, s, h, hd), cos.to(q.dtype), sin.to(q.dtype))
        k = rotate(k.view(b, s, kv, hd), cos.to(k.dtype), sin.to(k.dtype))
        v = v.view(b, s, kv, hd).contiguous()  # a copy: v is a strided slice of the projection
        if kv != h:
            k = k.repeat_interleave(h // kv, dim=2)
            v = v.repeat_interleave(h // kv, dim=2)
        out = self.kernel(q, k, v, causal=True)
        return self.proj(out.reshape(b, s, h * hd))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); `checkpoint_attention` recomputes the
    attention sublayer (norm included) in backward instead of saving its tensors."""

    def __init__(self, cfg: ModelConfig, kernel: nn.Module, checkpoint_attention: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = Attention(cfg, kernel)
        self.norm2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.checkpoint_attention = checkpoint_attention

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm1(x), cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_attention:
            a = checkpoint(self._attention, x, cos, sin, use_reentrant=False)
        else:
            a = self._attention(x, cos, sin)
        x = x + a
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def checkpointed_blocks(training: TrainingConfig, n_layers: int) -> list[bool]:
    """Which blocks are recomputed whole in backward under the training's policy."""
    if training.checkpointing == "blocks":
        return [True] * n_layers
    if training.checkpointing == "every_k":
        every = training.checkpoint_every or 1
        return [i % every == 0 for i in range(n_layers)]
    return [False] * n_layers


class Decoder(nn.Module):
    """Embedding, blocks, final norm, LM head; `loss(tokens, targets, positions, n)` is the
    sum of next-token cross-entropy over this rank's tokens divided by the global count n."""

    def __init__(
        self, cfg: ModelConfig, training: TrainingConfig, make_kernel: Callable[[], nn.Module]
    ) -> None:
        super().__init__()
        self.cfg, self.train_config = cfg, training  # nn.Module's `training` is its mode
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, make_kernel(), training.checkpointing == "attention")
            for _ in range(cfg.n_layers)
        )
        self.recompute = checkpointed_blocks(training, cfg.n_layers)
        self.compute_dtype = DTYPES[PRECISION_DTYPES[training.precision]]
        self.norm = nn.LayerNorm(cfg.d_model, bias=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.weight
        # GPT-2 style initialisation keeps fp16 activations in range; the values never
        # change what is measured.
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    @property
    def kernel(self) -> nn.Module:
        """The first block's attention kernel (every block has its own of the same config)."""
        attn = self.blocks[0].attn
        assert isinstance(attn, Attention)
        return attn.kernel

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (B, S, d_model) of these tokens at these positions."""
        x = self.embed(tokens)
        # in the dtype q and k have, so that no block makes its own copy
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.compute_dtype)
        for block, recompute in zip(self.blocks, self.recompute, strict=True):
            if recompute:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.norm(x)

    def _token_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")

    def loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor,
        n_tokens: int,
    ) -> torch.Tensor:
        """Summed next-token loss of this rank's tokens / n_tokens (the global count, so the
        ranks' gradients add up to the full batch's)."""
        h = self.hidden(tokens, positions)
        chunk = self.train_config.loss_chunk_tokens
        if chunk is None:
            return self._token_loss(h, targets) / n_tokens
        flat_h, flat_t = h.flatten(0, 1), targets.flatten()
        total = h.new_zeros((), dtype=torch.float32)
        for start in range(0, flat_t.numel(), chunk):
            part = slice(start, start + chunk)
            total = total + checkpoint(
                self._token_loss, flat_h[part], flat_t[part], use_reentrant=False
            )
        return total / n_tokens


def token_ids(positions: torch.Tensor, vocab_size: int, seed: int) -> torch.Tensor:
    """A deterministic pseudo-random token at each global position (a multiplicative hash):
    every rank and world size sees the same sequence without materializing all of it."""
    mixed = (positions.to(torch.int64) + (seed + 1) * 0x9E3779B1) * 0x85EBCA6B
    return (mixed >> 11).remainder(vocab_size)
