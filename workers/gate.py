"""The correctness gate: a kernel checked against its float64 reference at its own scale.

Two checks on the run's own seeded inputs (workers.inputs), output and, in train mode, the
gradients of q, k and v:

- the full check: every query row, at the smallest length that holds each structural period of
  the kernel (segment, window, block; KernelSpec.periods) at least twice (`full_length`);
- the sampled check: a few hundred query rows at the run's own length (`sample_rows`: the first
  and last rows, both sides of every period and shard boundary, and seeded random rows). The
  kernel runs the whole sequence with dout kept on those rows only, so its loss is the
  reference's: exact for those rows' dq and for every row of dk and dv.

The reference is computed a chunk of rows at a time (workers.references takes the rows it
computes), so the sampled check costs O(rows x seq_len) and the full check no (S, S) matrix.

The tolerance: float32 has a fixed one (CHECK_ATOL, about ten times dense SDPA's own float32
error). In float16 and bfloat16 the dtype's own rounding dominates and grows with the
gradients' magnitude: on a tiny decoder's attention (4 heads of 32, causal, train, 1,024
tokens) dense SDPA in bfloat16 is off its float64 reference by 8.2e-02 (dq) and dilated by
7.2e-02, so the fixed 6e-02 this gate had refused a kernel more accurate than dense itself,
while in forward mode (dense off by 7.8e-03) it passed a kernel missing a key (off by 4.5e-02).
So each check there also measures dense SDPA's error on the same inputs, length, rows (and
mask: a run's params.mask, as an explicit attn_mask) in the run's dtype against the same float64
reference (`dense_error`), and allows HALF_FACTOR times it (never less than the dtype's eps:
the rounding of a value of 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attention
from attention.mask import Mask
from attention.mask import parse as parse_mask
from attention.ring.comm import wait_all
from workers import kernels, references
from workers.config import RunConfig
from workers.inputs import batch_rows, make_input, shorter_length
from workers.kernels import DTYPES
from workers.memory import is_oom

CHECK_ATOL = {"float32": 1e-4}
"""Max abs error allowed against a float64 reference (references.REFERENCE_DTYPE) in float32; a
half-precision dtype's is measured (`tolerance`)."""
HALF_DTYPES = ("float16", "bfloat16")
"""Dtypes whose tolerance is measured against dense SDPA's own error (`dense_error`)."""
HALF_FACTOR = 2.0
"""A half-precision kernel may be off by this many times dense SDPA's own error."""
CHECK_MIN_LEN = 128
"""The full check runs at no less than this (or the run's length when shorter)."""
RANDOM_ROWS = 64
"""Seeded random query rows of the sampled check, beside its edges and boundaries."""
MAX_BOUNDARIES = 96
"""Period and shard boundaries the sampled check covers (both sides of each): evenly spread
over all of them when there are more (a 128K block_sparse at block 64 has 2,047)."""
CHUNK_BYTES = 64 * 2**20
"""Bound on one reference chunk's float64 scores (rows x seq_len x batch x heads)."""


class CheckOutOfMemory(MemoryError):
    """An allocation failure inside the gate, its message naming the check's length (an OOM
    to the protocol: workers.memory.is_oom)."""


@dataclasses.dataclass(frozen=True)
class GateResult:
    """What the gate measured: the full check's length and error, and the sampled check's
    (None when the run's length is the full check's: every row was checked); in a
    half-precision dtype, dense SDPA's own error at each (`dense_error`; None in float32)."""

    full_seq_len: int
    full_error: float
    sampled_seq_len: int | None = None
    sampled_error: float | None = None
    sampled_rows: int | None = None
    full_dense_error: float | None = None
    sampled_dense_error: float | None = None

    @property
    def max_error(self) -> float:
        """The worse of the two errors (NaN when either is)."""
        errors = [self.full_error, self.sampled_error]
        return max((e for e in errors if e is not None), key=lambda e: (math.isnan(e), e))

    def passed(self, dtype: str) -> bool:
        """Each check's error within its tolerance (`tolerance`; a NaN fails)."""
        full = self.full_error <= tolerance(dtype, self.full_dense_error)
        if self.sampled_error is None:
            return bool(full)
        return bool(full and self.sampled_error <= tolerance(dtype, self.sampled_dense_error))

    def summary(self) -> str:
        """Both lengths and both errors, e.g. '2.1e-07 at 512 (every row); 3.0e-07 at 16,384
        (230 rows)'."""
        text = f"{self.full_error:.1e} at {self.full_seq_len:,} (every row)"
        if self.sampled_seq_len is not None and self.sampled_error is not None:
            text += f"; {self.sampled_error:.1e} at {self.sampled_seq_len:,}"
            text += f" ({self.sampled_rows} rows)"
        return text

    def tolerance_text(self, dtype: str) -> str:
        """The tolerance the errors were held to, in words: '0.0001' in float32; in a
        half-precision dtype what it was at each check and the dense error it derives from."""
        if self.full_dense_error is None:
            return f"{CHECK_ATOL[dtype]:g}"
        checks = [(self.full_dense_error, self.full_seq_len, "every row")]
        if self.sampled_dense_error is not None and self.sampled_seq_len is not None:
            checks.append(
                (self.sampled_dense_error, self.sampled_seq_len, f"{self.sampled_rows} rows")
            )
        parts = [
            f"{tolerance(dtype, e):.1e} at {n:,} (dense SDPA's own {dtype} error {e:.1e} on {rows})"
            for e, n, rows in checks
        ]
        eps = torch.finfo(DTYPES[dtype]).eps
        return "; ".join(parts) + f": {HALF_FACTOR:g}x dense's own error, at least {eps:.1e}"


def tolerance(dtype: str, dense: float | None) -> float:
    """The max abs error allowed in `dtype`: CHECK_ATOL in float32; in a half-precision dtype
    HALF_FACTOR x dense SDPA's own error `dense`, at least the dtype's eps (also when `dense`
    is NaN)."""
    if dtype not in HALF_DTYPES:
        return CHECK_ATOL[dtype]
    if dense is None:
        raise ValueError(f"the {dtype} tolerance needs dense SDPA's own error (dense_error)")
    return max(torch.finfo(DTYPES[dtype]).eps, HALF_FACTOR * dense)


def full_length(config: RunConfig) -> int:
    """The full check's length: the smallest valid divisor of seq_len holding every
    structural period of the kernel twice, and no less than CHECK_MIN_LEN; seq_len at most."""
    periods = attention.structural_periods(config.kernel, kernels.kernel_params(config))
    return shorter_length(config, max(CHECK_MIN_LEN, 2 * max(periods, default=0)))


def _boundaries(config: RunConfig, length: int) -> list[int]:
    """Every multiple of a structural period, and every shard boundary of a sequence-parallel
    run (contiguous and zigzag halves), below `length`; evenly thinned to MAX_BOUNDARIES."""
    periods = list(attention.structural_periods(config.kernel, kernels.kernel_params(config)))
    world = kernels.shard_world(config)
    if world > 1:
        periods += [length // world, max(1, length // (2 * world))]
    found = sorted({b for p in periods if p < length for b in range(p, length, p)})
    if len(found) <= MAX_BOUNDARIES:
        return found
    return [found[i * len(found) // MAX_BOUNDARIES] for i in range(MAX_BOUNDARIES)]


def sample_rows(config: RunConfig, length: int) -> torch.Tensor:
    """The sampled check's query rows at `length`, sorted: the first two and last two, both
    sides of every boundary (`_boundaries`), and RANDOM_ROWS seeded by the run's seed."""
    rows = {0, 1, length - 2, length - 1}
    for b in _boundaries(config, length):
        rows.update((b - 1, b))
    gen = torch.Generator().manual_seed(config.seed * 7919 + length)
    rows.update(torch.randint(0, length, (RANDOM_ROWS,), generator=gen).tolist())
    return torch.tensor(sorted(r for r in rows if 0 <= r < length), dtype=torch.int64)


def run_gate(config: RunConfig, rank: int, device: torch.device, kind: str) -> GateResult:
    """The gate of one run on this rank (every rank of the run calls it: ring kernels and the
    all-reduce of the error are collective). A correctness run checks every row at its own
    length; others check every row at `full_length` and, when that is shorter, sampled rows at
    the run's length. A failing full check is returned without the sampled one."""
    length = config.seq_len if kind == "correctness" else full_length(config)
    at_full = config.model_copy(update={"seq_len": length})
    error = _check(at_full, rank, device, None)
    gate = GateResult(
        full_seq_len=length,
        full_error=error,
        full_dense_error=_baseline(at_full, rank, device, None),
    )
    if length == config.seq_len or not gate.passed(config.dtype):
        return gate
    rows = sample_rows(config, config.seq_len)
    sampled = _check(config, rank, device, rows)
    return dataclasses.replace(
        gate,
        sampled_seq_len=config.seq_len,
        sampled_error=sampled,
        sampled_rows=len(rows),
        sampled_dense_error=_baseline(config, rank, device, rows),
    )


def _baseline(
    config: RunConfig, rank: int, device: torch.device, rows: torch.Tensor | None
) -> float | None:
    """dense SDPA's own error for this check in a half-precision dtype; None in float32."""
    return dense_error(config, rank, device, rows) if config.dtype in HALF_DTYPES else None


def _check(config: RunConfig, rank: int, device: torch.device, rows: torch.Tensor | None) -> float:
    """Max abs error of the kernel built for `config` against its reference at config.seq_len,
    on `rows` (None: every row); an allocation failure raises CheckOutOfMemory."""
    try:
        return _checked(config, rank, device, rows)
    except Exception as exc:
        if not is_oom(exc):
            raise
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        which = "every row" if rows is None else f"{len(rows)} rows"
        raise CheckOutOfMemory(
            f"the correctness check at seq_len {config.seq_len} ({which}) ran out of memory: "
            f"{type(exc).__name__}: {line}"
        ) from exc


def _checked(
    config: RunConfig, rank: int, device: torch.device, rows: torch.Tensor | None
) -> float:
    """_check's work. A layer kernel's reference holds a float64 copy of the built module's
    weights (references.layer_reference); others need only their params."""
    module = kernels.build(config, device)
    if kernels.is_layer(config.kernel):
        reference = references.layer_reference(module)
    else:
        reference = references.reference_for(config.kernel, config.params)
    return max_error(config, module, reference, rank, device, rows)


def max_error(
    config: RunConfig,
    module: torch.nn.Module,
    reference: references.Reference,
    rank: int,
    device: torch.device,
    rows: torch.Tensor | None = None,
) -> float:
    """Max abs difference of `module` and `reference` at config.seq_len on the seeded inputs,
    on the query rows `rows` (None: all): their outputs and, in train mode, their dq and every
    row's dk and dv (the loss restricted to those rows); the maximum over all ranks."""
    length, train = config.seq_len, config.mode == "train"
    names = ["q", "k", "v", "dout"] if train else ["q", "k", "v"]
    every = torch.arange(length)
    full = {
        n: make_input(n, config, length, every, batch_rows(config, rank), device) for n in names
    }
    at = (every if rows is None else rows).to(device)
    sworld = kernels.shard_world(config)
    local = kernels.local_positions(module, config, length, rank if sworld > 1 else 0, sworld)
    local = local.to(device)
    got = _kernel_side(config, module, full, at, local)
    want = _reference_side(config, reference, full, at)
    # the checked rows this rank holds: index i of `local`, index j of `at`
    held = torch.isin(local, at).nonzero().flatten()
    in_at = torch.searchsorted(at, local[held])
    errors = [_diff(got["out"][:, held], want["out"][:, in_at])]
    if train:
        errors.append(_diff(got["q"][:, held], want["q"][:, in_at]))
        errors += [_diff(got[n], want[n][:, local]) for n in ("k", "v")]
    error = torch.stack(errors).max().to(device)
    if config.world_size > 1:  # async + wait_all: in the gate's ring abort scope
        wait_all([dist.all_reduce(error, op=dist.ReduceOp.MAX, async_op=True)])
    return float(error)


def _diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Max abs difference in float64 (0 for empty tensors: a rank holding no checked row)."""
    if a.numel() == 0:
        return torch.zeros((), dtype=references.REFERENCE_DTYPE, device=a.device)
    return (a.to(references.REFERENCE_DTYPE) - b).abs().max()


def _kernel_side(
    config: RunConfig,
    module: torch.nn.Module,
    full: dict[str, torch.Tensor],
    at: torch.Tensor,
    local: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The kernel on this rank's positions `local`: its output and, in train mode, the
    gradients of the loss sum(out * dout) over the rows `at` only (dout zero elsewhere).

    Forward mode runs under no_grad, as the timed forward iterations do
    (workers.protocol._timed_loop): a compiled kernel's graph is keyed on the grad mode, so the
    check then reuses the graph the iterations run instead of compiling one more per length."""
    train = config.mode == "train"
    loc = {n: full[n][:, local].detach().requires_grad_(train) for n in ("q", "k", "v")}
    with torch.set_grad_enabled(train):
        out = module(loc["q"], loc["k"], loc["v"], causal=config.causal)
    if not train:
        return {"out": out.detach()}
    keep = torch.zeros(config.seq_len, dtype=torch.bool, device=at.device)
    keep[at] = True
    kept = keep[local].view(1, -1, *([1] * (full["dout"].dim() - 2)))
    out.backward(full["dout"][:, local] * kept)
    grads = {n: t.grad for n, t in loc.items()}
    return {"out": out.detach(), **{n: g for n, g in grads.items() if g is not None}}


def _reference_side(
    config: RunConfig,
    reference: references.Reference,
    full: dict[str, torch.Tensor],
    at: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The reference on the rows `at`, a chunk of rows at a time (CHUNK_BYTES of scores): the
    output and dq of those rows and, in train mode, dk and dv of every row, from the loss
    sum(out * dout) over those rows (each chunk's graph freed by its own backward)."""
    train, ref = config.mode == "train", references.REFERENCE_DTYPE
    k, v = (full[n].to(ref).requires_grad_(train) for n in ("k", "v"))
    per_row = 8 * full["q"].shape[0] * config.num_heads * config.seq_len
    chunk = max(1, CHUNK_BYTES // per_row)
    outs, dqs = [], []
    for part in at.split(chunk):
        q = full["q"][:, part].to(ref).requires_grad_(train)
        out = reference(q, k, v, config.causal, part)
        if train:
            (out * full["dout"][:, part].to(ref)).sum().backward()
            dqs.append(q.grad)
        outs.append(out.detach())
    result = {"out": torch.cat(outs, dim=1)}
    if train:
        result.update(q=torch.cat(dqs, dim=1), k=k.grad, v=v.grad)
    return result


def dense_error(
    config: RunConfig, rank: int, device: torch.device, rows: torch.Tensor | None
) -> float:
    """Max abs error of dense SDPA in config.dtype against the float64 dense reference at
    config.seq_len on the query rows `rows` (None: every row), with the run's seeded q, k, v,
    dout, heads and causal flag: output and, in train mode, dq, dk and dv; the maximum over
    every rank of the run, so that all ranks judge alike.

    Dense runs on the checked rows only: with dout zero on the other rows (the gate's loss),
    their output and dq and every row's dk and dv are those of the whole sequence, so a sampled
    check at a run's full length costs O(rows x seq_len), as its reference does.
    """
    name, mask = attention.exact_dense(), _run_mask(config)
    params = {} if mask is None else {"mask": mask}
    dense = config.model_copy(update={"kernel": name, "params": params})
    length, train = config.seq_len, config.mode == "train"
    names = ["q", "k", "v", "dout"] if train else ["q", "k", "v"]
    every = torch.arange(length)
    part = batch_rows(config, rank)
    full = {n: make_input(n, dense, length, every, part, device) for n in names}
    at = (every if rows is None else rows).to(device)
    if mask is None:
        got = _sdpa_rows(full, at, config.causal, rows is None, train)
    else:
        got = _masked_sdpa_rows(full, at, parse_mask(mask, length), train)
    want = _reference_side(dense, references.reference_for(name, params), full, at)
    error = torch.stack([_diff(got[n], want[n]) for n in got]).max().to(device)
    if config.world_size > 1:  # async + wait_all: in the gate's ring abort scope
        wait_all([dist.all_reduce(error, op=dist.ReduceOp.MAX, async_op=True)])
    return float(error)


def _run_mask(config: RunConfig) -> dict[str, Any] | None:
    """The mask the run's kernel computes under (its params' `mask`: dense, the sharded
    kernels, ulysses), under which dense SDPA's own error is measured too; None: no mask."""
    mask = config.params.get("mask")
    return mask if isinstance(mask, dict) else None


def _masked_sdpa_rows(
    full: dict[str, torch.Tensor], at: torch.Tensor, mask: Mask, train: bool
) -> dict[str, torch.Tensor]:
    """_sdpa_rows under a mask: SDPA in the inputs' dtype with the mask's rows as its boolean
    attn_mask, a chunk of query rows at a time (the chunk's scores bounded as the reference's,
    never an (S, S) mask); dk and dv summed over the chunks in float32 and rounded once to the
    inputs' dtype, as one SDPA call over every row accumulates them."""
    k, v = (full[n].detach().requires_grad_(train) for n in ("k", "v"))
    batch, seq_len, heads = full["q"].shape[:3]
    chunk = max(1, CHUNK_BYTES // (8 * batch * heads * seq_len))
    outs, dqs = [], []
    dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
    for part in at.split(chunk):
        q = full["q"][:, part].detach().requires_grad_(train)
        groups = heads // k.shape[2]
        kh, vh = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
        keep = mask.rows(part, seq_len)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=keep)
        out = out.transpose(1, 2)
        if train:
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), full["dout"][:, part])
            dqs.append(dq)
            for total, grad in zip(dkv, (dk, dv), strict=True):
                total += grad
        outs.append(out.detach())
    got = {"out": torch.cat(outs, dim=1)}
    if train:
        got.update(q=torch.cat(dqs, dim=1), k=dkv[0].to(k.dtype), v=dkv[1].to(v.dtype))
    return got


def _sdpa_rows(
    full: dict[str, torch.Tensor], at: torch.Tensor, causal: bool, every: bool, train: bool
) -> dict[str, torch.Tensor]:
    """SDPA in the inputs' dtype on the query rows `at`: out and, in train mode, dq, dk, dv of
    sum(out * dout) over those rows. Every row runs is_causal; a subset an explicit mask."""
    q = full["q"][:, at].detach().requires_grad_(train)
    k, v = (full[n].detach().requires_grad_(train) for n in ("k", "v"))
    mask = None
    if causal and not every:
        mask = torch.arange(k.shape[1], device=at.device)[None, :] <= at[:, None]
    groups = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), kh, vh, attn_mask=mask, is_causal=causal and every
    ).transpose(1, 2)
    if not train:
        return {"out": out.detach()}
    out.backward(full["dout"][:, at])
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
