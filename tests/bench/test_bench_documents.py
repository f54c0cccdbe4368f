"""bench.documents at a tiny size: every configuration passes its gate, and the printed table is
the raw measurement's: the kept-pairs imbalance recomputed from an explicit mask, the measured
imbalances and times per pair recomputed from each rank's step-clock sums."""

from __future__ import annotations

import statistics

import pytest
import torch

from attention import layouts
from attention.mask import parse
from bench import documents

pytestmark = pytest.mark.timeout(240)

SEQ, WORLD, HEADS, MEAN = 1024, 2, 2, 128


def explicit_pairs(mask: dict, balance: str | None) -> list[int]:
    """Kept pairs of each rank's queries, counted on the (S, S) mask."""
    tokens = torch.arange(SEQ)
    keep = parse(mask, SEQ).keep(tokens[:, None], tokens[None, :])
    if balance is None:  # plain causal: the ring's default zigzag
        order = torch.cat([layouts.positions(SEQ, "zigzag", r, WORLD) for r in range(WORLD)])
    else:
        order = layouts.order(balance, SEQ, WORLD, mask)
    per_token = keep.sum(1)[order]
    return [int(x) for x in per_token.view(WORLD, -1).sum(1)]


def _ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of num / den."""
    return statistics.median(x / y for x, y in zip(num, den, strict=True))


def _median(xs: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def test_printed_numbers_are_the_measured_ones(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--seq", str(SEQ), "--world", str(WORLD), "--mean", str(MEAN), "--seeds", "0"]
    argv += ["--heads", str(HEADS), "--dim", "16", "--rounds", "2", "--iters", "2"]
    got = documents.main([*argv, "--warmup", "1", "--gate-seq", "256"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("setup: ring, causal documents")
    assert "W=2 gloo ranks x 1 thread" in printed[0] and "load average" in printed[0]
    rows = {line[:22].strip(): line[22:].split() for line in printed[2:7]}
    assert printed[7].split()[:4] == ["ns", "per", "kept", "pair"]
    times = {line[:22].strip(): line[22:].split() for line in printed[8:13]}
    mask = documents.documents_mask(SEQ, WORLD, MEAN, 0)
    expected = {f"seed 0 {b}": explicit_pairs(mask, b) for b in layouts.BALANCES}
    expected["causal"] = explicit_pairs({"kind": "causal"}, None)
    assert sorted(rows) == sorted(expected) == sorted(got["pairs"])
    assert sum(expected["causal"]) == SEQ * (SEQ + 1) // 2
    configs = documents.configurations(SEQ, WORLD, MEAN, [0])
    for name, per_rank in expected.items():
        assert got["pairs"][name] == per_rank
        pairs_imb = max(per_rank) / (sum(per_rank) / WORLD)
        assert rows[name][0] == f"{pairs_imb:.4f}"
        per_rank_rows = [r[0][name] for r in got["ranks"]]  # (rows, bare seconds)
        assert [len(r) for r in per_rank_rows] == [4] * WORLD  # 2 rounds x 2 timed
        its = list(zip(*per_rank_rows, strict=True))
        thread = [
            max(x["compute_thread_s"] for x in it)
            / statistics.mean(x["compute_thread_s"] for x in it)
            for it in its
        ]
        wall = [
            max(x["compute_s"] for x in it) / statistics.mean(x["compute_s"] for x in it)
            for it in its
        ]
        total = sum(per_rank) * HEADS
        ns = [sum(x["compute_thread_s"] for x in it) / total * 1e9 for it in its]
        iteration = [max(x["wall_s"] for x in it) / total * 1e9 for it in its]
        # the ring's plans compute exactly the kept pairs: a skipped pair is never computed
        blocks = documents.plan_figures(configs[name], SEQ, WORLD)[1]
        assert rows[name][-2:] == ["1.0000", str(blocks)]
        line = " ".join(rows[name])
        for xs in (thread, wall):
            assert _median(xs) in line
        # time per pair: the ring's, then its blocks' bare calls in the ranks (each rank's
        # seconds of a round summed) and alone (the parent's, one per round)
        rounds = [it[0]["round"] for it in its]
        per_round = list(zip(*(got["ranks"][r][1][name] for r in range(WORLD)), strict=True))
        in_ranks = [sum(x) / total * 1e9 for x in per_round]
        base_total = sum(expected["causal"]) * HEADS
        base_ranks = [
            sum(x) / base_total * 1e9
            for x in zip(*(got["ranks"][r][1]["causal"] for r in range(WORLD)), strict=True)
        ]
        alone = [x / total * 1e9 for x in got["alone"][name]]
        base_alone = [x / base_total * 1e9 for x in got["alone"]["causal"]]
        assert len(in_ranks) == len(alone) == 2  # 2 rounds
        ring_over_bare = [
            statistics.median(x for x, r in zip(ns, rounds, strict=True) if r == k) / b
            for k, b in enumerate(in_ranks)
        ]
        cols = times[name]  # each figure "median (min-max)", its ratios after it
        assert cols[:2] == _median(ns).split()
        assert cols[3:5] == _median(iteration).split()
        assert cols[6:8] == _median(in_ranks).split()
        assert cols[8] == f"{_ratio(in_ranks, base_ranks):.3f}"
        assert cols[9] == f"{statistics.median(ring_over_bare):.3f}"
        assert cols[10:12] == _median(alone).split()
        assert cols[12] == f"{_ratio(alone, base_alone):.3f}"
        for it in its:  # a step's compute lies inside its rank's iteration, on either clock
            for x in it:
                assert (
                    0 < x["compute_thread_s"] <= x["wall_s"] and 0 < x["compute_s"] <= x["wall_s"]
                )
    causal = got["summary"]["causal"]
    assert causal["thread_ratio"] == causal["wall_ratio"] == 1.0
    assert times["causal"][2] == times["causal"][5] == "1.000"
    verdict = printed[13]
    best = min(layouts.BALANCES, key=lambda b: got["summary"][f"seed 0 {b}"]["pairs_imbalance"])
    assert verdict.startswith(f"seed 0: best balance {best} ")
