"""Our kernels against the adapters of outside implementations, one process, same inputs.

Pairs (ours, theirs): block_sparse vs flex_block_sparse, dilated vs flex_dilated, dense vs sdpa
with each CPU backend. Each pair runs alternately for --rounds rounds (forward only: torch's
FlexAttention has no CPU backward), every call timed after a warm-up that also absorbs
torch.compile; printed: the median time of each, theirs / ours per round and the median ratio,
and the backend each reported. Every adapter's output is first checked against ours.

    .venv/bin/python bench/adapters.py [--seq 4096] [--heads 4] [--dim 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import attention

SPARSE = {"block_size": 128, "pattern": "local_window", "window": 2}
DILATED = {"segment_lengths": [512, 1024], "dilation_rates": [1, 2]}
PAIRS = [
    (("block_sparse", SPARSE), ("flex_block_sparse", SPARSE)),
    (("dilated", DILATED), ("flex_dilated", DILATED)),
    (("dense", {}), ("sdpa", {"backend": "math"})),
    (("dense", {}), ("sdpa", {"backend": "flash"})),
]


def timed(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        module(q, k, v)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(
        f"setup: forward, batch 1, seq {a.seq}, heads {a.heads}, head_dim {a.dim}, fp32 cpu, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; {a.rounds} alternating "
        f"rounds; os.cpu_count()={os.cpu_count()}"
    )
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, a.seq, a.heads, a.dim, generator=g) for _ in range(3))
    for (ours_name, ours_params), (theirs_name, theirs_params) in PAIRS:
        ours = attention.build(ours_name, **ours_params)
        theirs = attention.build(theirs_name, **theirs_params)
        with torch.no_grad():
            err = float((theirs(q, k, v) - ours(q, k, v)).abs().max())  # also the warm-up
            ours(q, k, v)
        if err > 1e-4:
            raise SystemExit(f"{theirs_name} differs from {ours_name}: max abs error {err:.2e}")
        t_ours, t_theirs = [], []
        for r in range(a.rounds):
            order = [(ours, t_ours), (theirs, t_theirs)]
            for module, times in order if r % 2 == 0 else order[::-1]:
                times.append(timed(module, q, k, v))
        ratios = [b / o for o, b in zip(t_ours, t_theirs, strict=True)]
        line = {
            "ours": ours_name,
            "theirs": f"{theirs_name} {json.dumps(theirs_params)}",
            "backend_theirs": theirs.backend,
            "ours_s": round(statistics.median(t_ours), 5),
            "theirs_s": round(statistics.median(t_theirs), 5),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "max_abs_error": err,
        }
        print(json.dumps(line))
        print(
            f"  {theirs_name} ({theirs.backend}) / {ours_name}: {line['ratio_median']:.2f}x the "
            f"time (range {line['ratio_range'][0]:.2f}-{line['ratio_range'][1]:.2f}); "
            f"{line['theirs_s'] * 1e3:.1f} ms vs {line['ours_s'] * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
