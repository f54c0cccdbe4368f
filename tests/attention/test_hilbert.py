"""The Hilbert ordering: a bijection of the token grid whose steps are grid neighbours."""

from __future__ import annotations

import pytest
import torch

from attention.hilbert import (
    check_hilbert_length,
    hilbert_permutation,
    inverse_permutation,
    is_power_of_four,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("seq_len", [1, 4, 16, 64, 256, 1024, 4096])
def test_permutation_is_a_bijection_with_an_inverse(seq_len) -> None:
    perm = hilbert_permutation(seq_len)
    assert perm.dtype == torch.long and perm.shape == (seq_len,)
    assert torch.equal(perm.sort().values, torch.arange(seq_len))
    inv = inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(seq_len))
    assert torch.equal(inv[perm], torch.arange(seq_len))
    x = torch.randn(2, seq_len, 3)
    assert torch.equal(x[:, perm][:, inv], x)


@pytest.mark.parametrize("seq_len", [16, 64, 1024])
def test_consecutive_positions_are_grid_neighbours(seq_len) -> None:
    side = int(seq_len**0.5)
    perm = hilbert_permutation(seq_len)
    rows, cols = perm // side, perm % side
    steps = (rows.diff().abs() + cols.diff().abs()).tolist()
    assert steps == [1] * (seq_len - 1)
    assert perm[0].item() == 0  # the curve starts in a corner


def test_first_quadrant_is_finished_before_the_next() -> None:
    perm = hilbert_permutation(64)
    first = perm[:16]
    assert ((first // 8) < 4).all() and ((first % 8) < 4).all()


@pytest.mark.parametrize("seq_len", [0, 2, 8, 32, 48, 100, 4097])
def test_lengths_that_are_not_powers_of_four_raise(seq_len) -> None:
    assert not is_power_of_four(seq_len)
    with pytest.raises(ValueError, match=rf"^seq_len: {seq_len} must be a power of 4"):
        check_hilbert_length(seq_len)
    with pytest.raises(ValueError, match=r"^seq_len"):
        hilbert_permutation(seq_len)
