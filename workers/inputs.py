"""A case's inputs: seeded q, k, v (and dout) built block by block, the same at every world size.

Shared by the timed run (workers.protocol) and the correctness gate (workers.gate), which must
see exactly the same values.
"""

from __future__ import annotations

import math

import torch

from workers import kernels
from workers.config import RunConfig
from workers.kernels import DTYPES

BLOCK = 1024  # inputs are generated in blocks of this many positions, each with its own seed
TENSORS = {"q": 0, "k": 1, "v": 2, "dout": 3}


def make_input(
    which: str,
    config: RunConfig,
    seq_len: int,
    positions: torch.Tensor,
    rows: slice,
    device: torch.device,
) -> torch.Tensor:
    """This rank's part of one global (batch, seq, heads, dim) tensor, built block by block.

    Every block of BLOCK positions has its own seed, so a rank materializes only the rows and
    positions it holds, and the global tensor is the same at every world size and layout.
    A layer kernel (kernels.is_layer) gets the same values as (batch, seq, embed_dim), embed_dim
    = heads x dim: a view of the same memory, so inputs and input bytes match the heads layout.
    """
    dtype = DTYPES[config.dtype]
    grouped = which in ("k", "v") and not kernels.is_layer(config.kernel)  # a layer projects
    h = config.kv_heads if grouped else config.num_heads
    d = config.head_dim
    n_rows = len(range(config.batch_size)[rows])
    out = torch.empty(n_rows, positions.numel(), h, d, device=device, dtype=dtype)
    sorted_pos, order = positions.sort()
    gen = torch.Generator(device=device)
    for block in range(math.ceil(seq_len / BLOCK)):
        lo_pos, hi_pos = block * BLOCK, min(seq_len, (block + 1) * BLOCK)
        lo = int(torch.searchsorted(sorted_pos, lo_pos))
        hi = int(torch.searchsorted(sorted_pos, hi_pos))
        if lo == hi:
            continue
        gen.manual_seed(((config.seed * 4 + TENSORS[which]) << 32) + block)
        shape = (config.batch_size, hi_pos - lo_pos, h, d)
        values = torch.randn(shape, generator=gen, device=device, dtype=dtype)[rows]
        src = (sorted_pos[lo:hi] - lo_pos).to(device)
        out[:, order[lo:hi].to(device)] = values[:, src]
        del values
    return out.flatten(2) if kernels.is_layer(config.kernel) else out


def batch_rows(config: RunConfig, rank: int) -> slice:
    if config.parallel == "data":
        lb = config.local_batch
        return slice(rank * lb, (rank + 1) * lb)
    return slice(None)


def shorter_length(config: RunConfig, minimum: int) -> int:
    """A shorter length of the same case: the smallest divisor of seq_len that is >= `minimum`
    and that the kernel accepts (seq_len itself when none is smaller). The gate's full check
    and the warm-up runs run there; a divisor keeps every shard and layout rule of the run."""
    n = config.seq_len
    if n <= minimum:
        return n
    divisors = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            divisors.update((d, n // d))
    for length in sorted(d for d in divisors if d >= minimum):
        if kernels.is_valid_length(config, length):
            return length
    return n
