"""How evenly each load balance shares a mask's work across ranks: kept pairs per rank.

`python -m bench.balance [--seq 16384] [--world 4] [--mean 2048] [--seeds 5]` samples causal
packed documents (lognormal lengths of the given mean, each at most a quarter of the sequence
and a multiple of 2 x world, as per_document needs; one draw per seed), orders the tokens by
each balance (attention.layouts.order: none, head_tail, per_document, ptrr) and prints, per
balance, the kept-pairs imbalance (max / mean over ranks, 1.0 even) of every seed and their
range. Exact counts from the mask's ranges: no attention is computed, no timing is involved.
"""

from __future__ import annotations

import argparse
from typing import Any

from attention import layouts
from attention.mask import expand


def documents_mask(seq: int, world: int, mean: int, seed: int) -> dict[str, Any]:
    """The study's mask: causal documents of lognormal lengths of `mean`, none over a quarter of
    the sequence, lengths written out (bench.gather and bench.documents sample the same)."""
    sampled = {
        "distribution": "lognormal",
        "mean": mean,
        "max_fraction": 0.25,
        "seed": seed,
        "multiple_of": 2 * world,
    }  # per_document halves each document on every rank
    return expand({"kind": "documents", "causal": True, "sampled": sampled}, seq)


def study_arguments(parser: argparse.ArgumentParser) -> None:
    """The study's sizes as every documents bench takes them: 16K tokens, W=4, mean 2K."""
    parser.add_argument("--seq", type=int, default=16384, help="tokens in the sequence")
    parser.add_argument("--world", type=int, default=4, help="ranks")
    parser.add_argument("--mean", type=int, default=2048, help="documents' mean length")


def study_setup(args: argparse.Namespace) -> str:
    """The study's setup as every documents bench prints it first."""
    return (
        f"setup: causal documents, lognormal lengths of mean {args.mean:,} tokens, each at most "
        f"{args.seq // 4:,} (a quarter), {args.seq:,} tokens on {args.world} ranks; ptrr blocks "
        "of 128"
    )


def imbalances(seq: int, world: int, mean: int, seed: int) -> dict[str, float]:
    """Balance -> kept-pairs imbalance for one sampled document mask."""
    mask = documents_mask(seq, world, mean, seed)
    out = {}
    for balance in layouts.BALANCES:
        order = layouts.order(balance, seq, world, mask)
        out[balance] = layouts.imbalance(layouts.rank_pairs(mask, order, world))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(parser)
    parser.add_argument("--seeds", type=int, default=5, help="masks sampled (seeds 0..n-1)")
    args = parser.parse_args(argv)
    print(f"{study_setup(args)}; kept pairs per rank, max / mean")
    rows = [imbalances(args.seq, args.world, args.mean, s) for s in range(args.seeds)]
    for balance in layouts.BALANCES:
        seen = [r[balance] for r in rows]
        each = " ".join(f"{x:.4f}" for x in seen)
        print(f"{balance:>12}: {min(seen):.4f}-{max(seen):.4f}  (seeds: {each})")


if __name__ == "__main__":
    main()
