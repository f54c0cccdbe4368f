"""bench.balance prints each balance's kept-pairs imbalance, recomputed here from the mask."""

from __future__ import annotations

import pytest
from _bench_helpers import rows_by_balance

from bench import balance


def test_the_printed_imbalances_are_the_masks_own(capsys: pytest.CaptureFixture[str]) -> None:
    rows = rows_by_balance(balance.main, capsys)
    for seed in (0, 1):
        for name, value in balance.imbalances(2048, 2, 256, seed).items():
            assert f"{value:.4f}" in rows[name].split("seeds:")[1]
            assert value >= 1.0
    assert balance.imbalances(2048, 2, 256, 0)["ptrr"] <= 1.05  # ptrr evens the pairs out
