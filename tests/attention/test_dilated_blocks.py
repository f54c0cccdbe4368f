"""flex_dilated's BlockMasks come from each branch's tiles (attention.dilated_blocks): equal to
create_block_mask's, tensor for tensor, at small sizes, and built at 64K tokens and 16 heads
within twice the BlockMask's own bytes (create_block_mask's (1, H, S, S) bool alone would be
64 GiB there)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import attention
from attention.dilated_blocks import branch_block_mask, dilated_mask_mod
from attention.masks import dilated_branch_mask
from workers.memory import CpuAllocatorLedger
from workers.references import REFERENCE_DTYPE, reference_for

FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip
CPU = torch.device("cpu")


def _own_bytes(mask: BlockMask) -> int:
    return sum(getattr(mask, name).untyped_storage().nbytes() for name in FIELDS)


@pytest.mark.parametrize(
    ("seq_len", "w", "r", "heads"),
    [
        (512, 256, 1, 2),  # two whole tiles per segment: full tiles (causal: below the diagonal)
        (1000, 96, 3, 4),  # segments straddle tiles; a short last tile and segment
        (640, 200, 2, 3),  # the last head group smaller than the others
        (384, 1, 1, 16),  # one-token segments: only the diagonal
        (300, 64, 5, 3),  # more rates than heads: groups without a head
        (256, 2048, 4, 16),  # one segment longer than the sequence
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_the_tiles_equal_create_block_mask(
    seq_len: int, w: int, r: int, heads: int, causal: bool
) -> None:
    mask_mod = dilated_mask_mod(w, r, math.ceil(heads / r), causal)
    want = create_block_mask(mask_mod, None, heads, seq_len, seq_len, device="cpu")
    got = branch_block_mask(w, r, heads, seq_len, causal, CPU)
    for name in FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.seq_lengths, got.BLOCK_SIZE) == (want.seq_lengths, want.BLOCK_SIZE)
    if r == 1 and w >= 256:
        assert int(got.full_kv_num_blocks.sum()) > 0  # full tiles were compared too
    # the mask_mod flex applies inside partial tiles: the definition's token mask
    pos = torch.arange(seq_len)
    rule = got.mask_mod(0, torch.arange(heads)[:, None, None], pos[:, None], pos[None, :])
    assert torch.equal(rule, dilated_branch_mask(seq_len, heads, w, r, causal=causal))


def test_flex_dilated_uses_the_tiles_and_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter's forward builds every branch from its tiles (create_block_mask refused)
    and matches the float64 dense reference on a length no tile or segment divides."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("create_block_mask materializes (1, H, S, S)")

    monkeypatch.setattr(torch.nn.attention.flex_attention, "create_block_mask", refused)
    params = {"segment_lengths": [96, 200], "dilation_rates": [1, 3]}
    module = attention.build("flex_dilated", **params, compiled=False)
    reference = reference_for("dilated", params)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 4, 16, generator=g) for _ in range(3))
    for causal in (False, True):
        got = module(q, k, v, causal=causal)
        want = reference(*(t.to(REFERENCE_DTYPE) for t in (q, k, v)), causal)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
        assert module.branch_mask(200, 3, q, causal).BLOCK_SIZE == (128, 128)  # cached


@pytest.mark.parametrize(("w", "r", "causal"), [(65536, 16, True), (8192, 4, False)])
def test_a_64k_build_holds_at_most_twice_its_mask(w: int, r: int, causal: bool) -> None:
    """At 64K tokens and h=16 the adapter's build (cache miss) peaks within 2x the BlockMask's
    own bytes (64 MiB), as c10's CPU allocator counts it (workers.memory)."""
    module = attention.build("flex_dilated", segment_lengths=[w], dilation_rates=[r])
    q = torch.empty(1, 65536, 16, 1)  # the mask needs q's heads, length and device only
    ledger = CpuAllocatorLedger()
    ledger.start()
    try:
        mask = module.branch_mask(w, r, q, causal)
        peak = ledger.peak()
    finally:
        ledger.stop()
    own = _own_bytes(mask)
    assert own == 4 * 16 * 512 * (512 + 1) * 4  # four index tensors and their counts, int32
    assert 0 < peak <= 2 * own, (peak, own)
