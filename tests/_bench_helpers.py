"""What the tests of the documents-study benches (bench.balance, bench.gather) share."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from attention import layouts

STUDY_ARGS = ["--seq", "2048", "--world", "2", "--mean", "256", "--seeds", "2"]
"""The study the tests run: 2,048 tokens on 2 ranks, documents of mean 256, seeds 0 and 1."""


def rows_by_balance(
    main: Callable[[list[str]], object], capsys: pytest.CaptureFixture[str]
) -> dict[str, str]:
    """Each balance's printed line, by name, of `main` run on STUDY_ARGS: its first line the
    setup, then one line per balance (every one of layouts.BALANCES)."""
    main(STUDY_ARGS)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("setup: causal documents")
    rows = {line.split(":")[0].strip(): line for line in printed[1:]}
    assert sorted(rows) == sorted(layouts.BALANCES)
    return rows
