"""bench.gather prints, per balance, the K/V bytes a rank receives under gather all and
needed, recomputed here from the dense mask and each balance's token order."""

from __future__ import annotations

import pytest
import torch
from _bench_helpers import rows_by_balance

from attention import layouts
from attention.mask import expand, parse
from bench import gather
from service.units import nbytes


def _dense_counts(seed: int, balance: str) -> tuple[list[int], list[int]]:
    """(rows each rank receives under all, rows its queries keep of them) from mask.dense."""
    sampled = {"distribution": "lognormal", "mean": 256, "max_fraction": 0.25, "seed": seed,
               "multiple_of": 4}  # fmt: skip
    mask = parse(expand({"kind": "documents", "causal": True, "sampled": sampled}, 2048), 2048)
    order = layouts.order(balance, 2048, 2, mask)
    keep = mask.dense(2048)
    shards = [order[:1024], order[1024:]]
    kept = [int(keep[shards[r]].any(0)[shards[1 - r]].sum()) for r in range(2)]
    return [1024, 1024], kept


def test_the_printed_bytes_are_the_masks_own(capsys: pytest.CaptureFixture[str]) -> None:
    rows = rows_by_balance(gather.main, capsys)
    for balance in layouts.BALANCES:
        every, kept = zip(*(_dense_counts(s, balance) for s in (0, 1)), strict=True)
        row = gather.ROW_BYTES
        for seed, got in enumerate(gather.moved(2048, 2, 256, s)[balance] for s in (0, 1)):
            assert got.all == [x * row for x in every[seed]]
            assert got.needed == got.mask_needs == [x * row for x in kept[seed]]
            pairs = zip(every[seed], kept[seed], strict=True)
            assert got.wasted_all == [(a - k) * row for a, k in pairs]
            # needed moves what all moves less the share all wasted
            assert sum(got.needed) == pytest.approx(sum(got.all) * (1 - got.wasted_share()))
            assert f"{got.wasted_share():.4f}" in rows[balance].split("seeds:")[1]
        mean_needed = torch.tensor(kept, dtype=torch.float64).mean().item() * row
        assert f"needed {nbytes(mean_needed)}" in rows[balance]
