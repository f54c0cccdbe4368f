"""Layouts: shard/unshard round trips, the zigzag/striped positions, and the divisibility errors."""

from __future__ import annotations

import pytest
import torch

from attention import layouts


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.randn(2, 24, 3, 4)
    parts = [layouts.shard(x, layout, r, world) for r in range(world)]
    assert all(p.shape == (2, 24 // world, 3, 4) for p in parts)
    torch.testing.assert_close(layouts.unshard(parts, layout), x, rtol=0, atol=0)
    pos = torch.cat([layouts.positions(24, layout, r, world) for r in range(world)])
    assert sorted(pos.tolist()) == list(range(24))  # a partition of the positions
    for r in range(world):
        torch.testing.assert_close(parts[r], x[:, layouts.positions(24, layout, r, world)])


def test_positions_by_definition():
    assert layouts.positions(8, "contiguous", 1, 2).tolist() == [4, 5, 6, 7]
    assert layouts.positions(8, "zigzag", 0, 2).tolist() == [0, 1, 6, 7]
    assert layouts.positions(8, "zigzag", 1, 2).tolist() == [2, 3, 4, 5]
    assert layouts.positions(8, "striped", 1, 2).tolist() == [1, 3, 5, 7]


def test_errors_name_the_numbers():
    x = torch.zeros(1, 12, 1)
    with pytest.raises(ValueError, match=r"seq_len: 12 must be divisible by 2 x world_size = 8"):
        layouts.shard(x, "zigzag", 0, 4)
    with pytest.raises(ValueError, match=r"seq_len: 12 must be divisible by world_size 5"):
        layouts.shard(x, "contiguous", 0, 5)
    with pytest.raises(ValueError, match=r"params.layout: must be one of"):
        layouts.shard(x, "diagonal", 0, 2)
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 2\), got 2"):
        layouts.positions(12, "striped", 2, 2)
    for layout in layouts.LAYOUTS:
        for rank in (-1, 2, 5):
            with pytest.raises(ValueError, match=rf"rank: must be in \[0, 2\), got {rank}"):
                layouts.shard(x, layout, rank, 2)
    with pytest.raises(ValueError, match=r"parts\[1\]: shape"):
        layouts.unshard([torch.zeros(1, 4), torch.zeros(1, 3)], "contiguous")
    with pytest.raises(ValueError, match=r"local seq 3 is odd"):
        layouts.unshard([torch.zeros(1, 3), torch.zeros(1, 3)], "zigzag")


def rank_relayout(rank: int, world: int) -> list[dict]:
    """Every (src, dst) pair: the moved shard, and the gradient that flowed back through it."""
    from attention.ring.relayout import relayout

    full = torch.randn(2, 24, 3, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, 24, 3, generator=torch.Generator().manual_seed(1))
    results = []
    for src in layouts.LAYOUTS:
        for dst in layouts.LAYOUTS:
            x = layouts.shard(full, src, rank, world).requires_grad_()
            moved = relayout(x, src, dst, None)
            (moved * layouts.shard(weight, dst, rank, world)).sum().backward()
            results.append({"moved": moved.detach(), "grad": x.grad})
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_relayout_moves_shards_and_gradients_between_every_pair(world):
    from _dist_helpers import run_ranks

    per_rank = run_ranks(rank_relayout, world)
    full = torch.randn(2, 24, 3, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, 24, 3, generator=torch.Generator().manual_seed(1))
    pairs = [(s, d) for s in layouts.LAYOUTS for d in layouts.LAYOUTS]
    for i, (src, dst) in enumerate(pairs):
        moved = layouts.unshard([r[i]["moved"] for r in per_rank], dst)
        torch.testing.assert_close(moved, full, rtol=0, atol=0, msg=f"{src} -> {dst}")
        grad = layouts.unshard([r[i]["grad"] for r in per_rank], src)
        torch.testing.assert_close(grad, weight, rtol=0, atol=0, msg=f"grad {src} -> {dst}")
