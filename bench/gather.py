"""What `allgather_kv` moves with `gather: all` and with `gather: needed`, per balance.

`python -m bench.gather [--seq 16384] [--world 4] [--mean 2048] [--seeds 5]` samples causal
packed documents as bench.balance does (lognormal lengths of the given mean, each at most a
quarter of the sequence and a multiple of 2 x world; one draw per seed), orders the tokens by
each balance (attention.layouts.order) and prints, per balance, the K/V bytes one rank receives
in a forward pass, averaged over the ranks and seeds: with gather all (every other shard), with
gather needed (only the rows its queries keep a pair with), the bytes its mask needs (the other
shards' rows its queries keep), and the wasted share of all (bytes of rows no query of the rank
keeps / bytes received) over the seeds. A token's K/V row is ROW_BYTES; the unit of the count
is one such row (attention.ring.needed). Exact counts from the mask's ranges: no attention is
computed, no timing is involved.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from attention import layouts
from attention.mask import parse
from attention.ring.needed import traffic
from bench.balance import documents_mask, study_arguments, study_setup
from service.units import nbytes

KV_HEADS = 8
HEAD_DIM = 128
DTYPE_BYTES = 2
ROW_BYTES = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES
"""One token's K and V rows: 8 key/value heads of 128 bf16 values each (4,096 bytes)."""


@dataclass(frozen=True)
class Moved:
    """Forward-pass K/V bytes of each rank (lists in rank order) under one balance and mask."""

    all: list[int]
    needed: list[int]
    mask_needs: list[int]
    wasted_all: list[int]

    def wasted_share(self) -> float:
        """Bytes of all that carried no kept pair / bytes all moved, over the ranks."""
        return sum(self.wasted_all) / sum(self.all)


def moved(seq: int, world: int, mean: int, seed: int) -> dict[str, Moved]:
    """Balance -> the bytes each rank moves for one sampled document mask."""
    mask = parse(documents_mask(seq, world, mean, seed), seq)
    out = {}
    for balance in layouts.BALANCES:
        order = layouts.order(balance, seq, world, mask)
        every = [traffic(mask, order, r, world, "all") for r in range(world)]
        kept = [traffic(mask, order, r, world, "needed") for r in range(world)]
        out[balance] = Moved(
            all=[t.received * ROW_BYTES for t in every],
            needed=[t.received * ROW_BYTES for t in kept],
            mask_needs=[t.needed * ROW_BYTES for t in every],
            wasted_all=[t.wasted * ROW_BYTES for t in every],
        )
    return out


def _mean(rows: list[Moved], field: str) -> float:
    values = [x for m in rows for x in getattr(m, field)]
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(parser)
    parser.add_argument("--seeds", type=int, default=5, help="masks sampled (seeds 0..n-1)")
    args = parser.parse_args(argv)
    print(
        f"{study_setup(args)}; K/V of a token {ROW_BYTES:,} bytes ({KV_HEADS} kv heads x "
        f"{HEAD_DIM} bf16); bytes one rank receives per forward pass, mean over ranks and seeds"
    )
    rows = [moved(args.seq, args.world, args.mean, s) for s in range(args.seeds)]
    for balance in layouts.BALANCES:
        seen = [r[balance] for r in rows]
        shares = [m.wasted_share() for m in seen]
        each = " ".join(f"{x:.4f}" for x in shares)
        print(
            f"{balance:>12}: all {nbytes(_mean(seen, 'all'))}, needed "
            f"{nbytes(_mean(seen, 'needed'))}, mask needs {nbytes(_mean(seen, 'mask_needs'))}; "
            f"wasted share of all {min(shares):.4f}-{max(shares):.4f} (seeds: {each})"
        )


if __name__ == "__main__":
    main()
