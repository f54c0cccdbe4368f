"""`flex_block_sparse`, `flex_dilated`: torch FlexAttention running our block_sparse and
dilated patterns, to compare our kernels with the compiler's.

- `flex_block_sparse` takes block_sparse's params and masks tokens by its block mask (the same
  `block_mask` our kernel computes), causal within it when causal.
- `flex_dilated` takes dilated's params and runs one FlexAttention call per branch (w, r) with
  that branch's mask (LongNet's segments and head groups, dilated_branch_mask's definition),
  returning the log-sum-exp, and merges the branches by it, as `dilated` does.

`compiled` true runs FlexAttention compiled (attention.compiled: fullgraph, a recompile limit
that raises, RINGLAB_COMPILE_BACKEND's backend, inductor by default), what FlexAttention is for
(the first call per shape compiles, which the warm-up at the run's own length absorbs); false
runs it eagerly, which materializes the scores; None (the default) compiles where torch can:
everywhere but flex_dilated on CPU under Inductor, whose compiled CPU kernel cannot return the
log-sum-exp the branch merge needs (asking for it there is a params.compiled error). `backend`
in the results says which ran. Natural token order only. On CPU torch's FlexAttention has no
backward: train mode runs on CUDA, or on CPU under RINGLAB_COMPILE_BACKEND=eager or aot_eager
(FlexAttention's op and its own autograd); otherwise a CPU train run fails saying so.

BlockMasks are cached on the module per (pattern, heads, length, device), at most
MASK_CACHE_SIZE of them (MaskCache): a shape's masks are built by its first forward, which in a
run is the warm-up's, so the timed iterations (warmup >= 1) time the kernel alone; each forward
records the seconds it spent building masks as `mask_build_s` (0.0 from the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

try:  # torch >= 2.9 asks for the lse this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

from attention import compiled, dilated_blocks
from attention.adapters import adapter_specs
from attention.base import Kernel
from attention.block_sparse import (
    BlockSparseAttention,
    BlockSparseParams,
    block_sparse_periods,
    check_block_sparse,
)
from attention.block_sparse import cuda as block_sparse_flex
from attention.dilated import DilatedAttention, DilatedParams
from attention.errors import ParamError
from attention.masks import block_token_mask, block_token_rows
from attention.registry import KernelSpec


def _check_flex_params(params: Any) -> None:
    """The flex adapters' rules on the params they inherit: natural order only, and no `plan`
    to choose (the adapters run their own FlexAttention calls, not our kernels' plans)."""
    if params.ordering != "natural":
        raise ParamError("params.ordering", "the flex adapters take natural order only")
    if params.plan != "auto":  # inherited from dilated's params: none to choose here
        raise ParamError(
            "params.plan", "is dilated's; this kernel makes one FlexAttention call per branch"
        )


def _compile_backend(params: Any, device: torch.device) -> str | None:
    """The backend a flex adapter compiles with on `device` (None: it runs eagerly): none when
    params.compiled is false; else attention.compiled's, inductor on CPU without the setting.
    """
    if params.compiled is False:
        return None
    return compiled.backend(device.type, cpu_default="inductor")


def _check_trainable(q: torch.Tensor, chosen: str | None) -> None:
    """CPU train mode runs only through the eager compile backends (RINGLAB_COMPILE_BACKEND
    eager or aot_eager: FlexAttention's op and its autograd); torch's public FlexAttention and
    Inductor's CPU kernel have no backward."""
    if chosen in ("eager", "aot_eager"):
        return
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(
            "mode: torch's FlexAttention has no backward on CPU; run flex kernels in mode "
            "forward on CPU (train on CUDA, or on CPU under RINGLAB_COMPILE_BACKEND=eager)"
        )


MASK_CACHE_SIZE = 8
"""BlockMasks a flex module keeps (least recently used dropped first): a sweep's lengths, each
causal or not, without holding every mask a long search probed."""


class MaskCache:
    """A flex module's BlockMasks by (pattern key, heads, seq_len, device), bounded by
    MASK_CACHE_SIZE. Building one is not free (flex_dilated's come from each branch's tiles,
    attention.dilated_blocks; flex_block_sparse's from the (n, n) block mask,
    attention.block_sparse.cuda; neither holds an (S, S) mask), so a mask is built on the first
    forward of a shape (the warm-up's) and reused; `build_s` holds the seconds the module's last
    forward spent building masks (0.0 when every mask came from the cache), which the module
    reports as `mask_build_s`."""

    def __init__(self) -> None:
        self._masks: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.build_s = 0.0

    def get(self, pattern: tuple[Any, ...], build: Callable[[], Any], q: torch.Tensor) -> Any:
        """The BlockMask of `pattern` for q's heads, length and device; `build()` makes it on a
        miss only."""
        _, s, h, _ = q.shape
        key = (*pattern, h, s, str(q.device))
        if key in self._masks:
            self._masks.move_to_end(key)
            return self._masks[key]
        start = time.perf_counter()
        mask = build()
        if q.device.type == "cuda":  # its kernels run asynchronously: time them whole
            torch.cuda.synchronize(q.device)
        self.build_s += time.perf_counter() - start
        self._masks[key] = mask
        while len(self._masks) > MASK_CACHE_SIZE:
            self._masks.popitem(last=False)
        return mask


def _flex(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: Any,
    chosen: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention on (b, s, h, d) tensors under `block_mask`: out (b, s, h, d), and for
    flex_dilated the log-sum-exp (b, h, s). `chosen`: the compiled kernel `name` of
    attention.compiled with that backend; None: torch's flex_attention uncompiled (which
    materializes the scores)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    lse = name == "flex_dilated"
    if chosen is not None:
        got = compiled.KERNELS[name](chosen, qt, kt, vt, block_mask)
    else:
        extra: dict[str, Any] = {}
        if lse:
            extra = {"return_aux": AuxRequest(lse=True)} if AuxRequest else {"return_lse": True}
        got = flex_attention(
            qt, kt, vt, block_mask=block_mask, enable_gqa=k.shape[2] != q.shape[2], **extra
        )
    if not lse:
        return got.transpose(1, 2), None
    out, aux = got
    if chosen is None and AuxRequest is not None:
        aux = aux.lse
    return out.transpose(1, 2), aux


def _backend(chosen: str | None) -> str:
    return "flex-compiled" if chosen is not None else "flex-eager"


class _FlexKernel(Kernel):
    """What both flex adapters hold: their params, `ours` (our kernel of the same pattern: its
    mask and its FLOPs) and their BlockMask cache; `mask_build_s` is the seconds the last
    forward spent building masks."""

    def __init__(self, params: Any, ours: Kernel) -> None:
        super().__init__()
        self.params = params
        self.ours = ours
        self.masks = MaskCache()
        self.mask_build_s = 0.0

    def flops(self, *args: Any, **kwargs: Any) -> int:
        return self.ours.flops(*args, **kwargs)

    def compiles(self, device: torch.device) -> bool:
        """Whether a forward on `device` runs a compiled kernel (attention.compiled)."""
        return self._backend_on(device) is not None

    def _backend_on(self, device: torch.device) -> str | None:
        return _compile_backend(self.params, device)


@dataclass(frozen=True)
class FlexBlockSparseParams(BlockSparseParams):
    """block_sparse's params, and `compiled` (torch.compile the FlexAttention call; None:
    yes)."""

    compiled: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_flex_params(self)

    def ours(self) -> BlockSparseParams:
        names = [f.name for f in dataclasses.fields(BlockSparseParams)]
        return BlockSparseParams(**{n: getattr(self, n) for n in names})


class FlexBlockSparse(_FlexKernel):
    """block_sparse's pattern through FlexAttention."""

    def __init__(self, params: FlexBlockSparseParams) -> None:
        super().__init__(params, BlockSparseAttention(params.ours()))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        chosen = _compile_backend(self.params, q.device)
        _check_trainable(q, chosen)
        bs, seq_len = self.params.block_size, q.shape[1]

        def build() -> Any:  # tiles of at least 128 tokens: what compiled flex is tuned for
            tile = block_sparse_flex.tile_size(bs, "cuda")
            blocks = self.ours.block_mask(seq_len)
            return block_sparse_flex.build_block_mask(blocks, seq_len, bs, causal, tile, q.device)

        self.backend = _backend(chosen)
        self.masks.build_s = 0.0
        block_mask = self.masks.get(("block_sparse", causal), build, q)
        self.mask_build_s = self.masks.build_s
        return _flex("flex_block_sparse", q, k, v, block_mask, chosen)[0]


def block_sparse_keep(
    params: FlexBlockSparseParams, seq_len: int, causal: bool, device: torch.device
) -> torch.Tensor:
    """The gate's mask: our block_sparse's token mask (the reference tests ours against)."""
    ours = BlockSparseAttention(params.ours())
    keep = block_token_mask(ours.block_mask(seq_len), params.block_size, causal=causal,
                            seq_len=seq_len)  # fmt: skip
    return keep.to(device)


def block_sparse_keep_rows(
    params: FlexBlockSparseParams, seq_len: int, causal: bool, rows: torch.Tensor
) -> torch.Tensor:
    """The rows `rows` of block_sparse_keep, without the (seq_len, seq_len) mask."""
    ours = BlockSparseAttention(params.ours())
    return block_token_rows(ours.block_mask(seq_len), params.block_size, rows, seq_len, causal)


@dataclass(frozen=True)
class FlexDilatedParams(DilatedParams):
    """dilated's params, and `compiled` (torch.compile the FlexAttention calls; None: where
    torch can return the log-sum-exp compiled, i.e. not on CPU)."""

    compiled: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_flex_params(self)

    def ours(self) -> DilatedParams:
        return DilatedParams(self.segment_lengths, self.dilation_rates, self.ordering)


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place log-sum-exp merge (autograd through it): rows empty in both stay 0."""
    if out is None or lse is None:
        return out_b, lse_b
    total = torch.logaddexp(lse, lse_b)
    empty = torch.isneginf(total)  # no branch yet covers the row: its weights are 0, not NaN
    safe = torch.where(empty, torch.zeros_like(total), total)
    wa = torch.where(empty, 0.0, torch.exp(lse - safe)).transpose(1, 2).unsqueeze(-1)
    wb = torch.where(empty, 0.0, torch.exp(lse_b - safe)).transpose(1, 2).unsqueeze(-1)
    return out * wa + out_b * wb, total


class FlexDilated(_FlexKernel):
    """LongNet dilated attention, one FlexAttention call per branch, merged by lse."""

    def __init__(self, params: FlexDilatedParams) -> None:
        super().__init__(params, DilatedAttention(params.ours()))

    def branch_mask(self, w: int, r: int, q: torch.Tensor, causal: bool) -> Any:
        """Branch (w, r)'s BlockMask for q's heads, length and device, from the cache or built
        from its tiles (attention.dilated_blocks: no (S, S) mask)."""
        _, s, h, _ = q.shape
        build = functools.partial(dilated_blocks.branch_block_mask, w, r, h, s, causal, q.device)
        return self.masks.get(("dilated", w, r, causal), build, q)

    def _backend_on(self, device: torch.device) -> str | None:
        """The compile backend on `device` (_compile_backend), except on CPU without an eager
        backend: Inductor's CPU FlexAttention cannot return the log-sum-exp the branch merge
        needs, so unset `compiled` runs eagerly there and `compiled: true` is an error."""
        chosen = _compile_backend(self.params, device)
        if device.type != "cpu" or chosen in (None, "eager", "aot_eager"):
            return chosen
        if self.params.compiled:
            raise ParamError(
                "params.compiled",
                "torch.compile's CPU FlexAttention cannot return the log-sum-exp that merging "
                "the dilated branches needs; leave compiled unset (eager on CPU), run on CUDA, "
                "or set RINGLAB_COMPILE_BACKEND=eager",
            )
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
    ) -> torch.Tensor:
        chosen = self._backend_on(q.device)
        _check_trainable(q, chosen)
        self.backend = _backend(chosen)
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        self.masks.build_s = 0.0
        for w, r in zip(self.params.segment_lengths, self.params.dilation_rates, strict=True):
            block_mask = self.branch_mask(w, r, q, causal)
            out_b, lse_b = _flex("flex_dilated", q, k, v, block_mask, chosen)
            assert lse_b is not None
            out, lse = _merge(out, lse, out_b.float(), lse_b.float())
        self.mask_build_s = self.masks.build_s
        assert out is not None
        return out.to(q.dtype)


def check_flex_block_sparse(params: FlexBlockSparseParams, **shape: Any) -> None:
    """block_sparse's own rules on the run's shape."""
    check_block_sparse(params.ours(), **shape)


def flex_head_dim_problem(params: Any, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a flex adapter cannot run `head_dim` on CUDA: compiled (`compiled` true, or None:
    compiled on CUDA) FlexAttention's least head_dim; eager flex takes any."""
    return None if params.compiled is False else block_sparse_flex.head_dim_problem(head_dim)


def block_sparse_specs() -> list[KernelSpec]:
    return adapter_specs(
        "flex_block_sparse",
        "block_sparse's pattern through torch FlexAttention (compiled).",
        FlexBlockSparseParams,
        FlexBlockSparse,
        keep_mask=block_sparse_keep,
        keep_rows=block_sparse_keep_rows,
        check=check_flex_block_sparse,
        periods=lambda params: block_sparse_periods(params.ours()),
        cuda_head_dim=flex_head_dim_problem,
    )


def dilated_specs() -> list[KernelSpec]:
    return adapter_specs(
        "flex_dilated",
        "LongNet dilated attention through torch FlexAttention, one call per branch merged by "
        "log-sum-exp.",
        FlexDilatedParams,
        FlexDilated,
        twin="dilated",
        cuda_head_dim=flex_head_dim_problem,
    )
