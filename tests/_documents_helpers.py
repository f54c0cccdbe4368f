"""A sweep under a documents mask stored through the scheduler's own write path (leases.claim_next,
completion_from_outcome, write.finish) with outcomes computed from each run's config alone:
every scheme's ranks hold their kept pairs (an uneven share without a balance), their steps'
compute seconds, forward and backward times; dense at W=1 is the single-process partner.
And the readers of report.md's "Packed documents: balance and schemes" section, and what it
shows recomputed from a run's raw rank fields (the API's rank_results).
"""

from __future__ import annotations

import re
from typing import Any

from _results_helpers import timing

from attention.mask import parse
from service import leases
from service.results import write
from service.results.write import completion_from_outcome
from workers.config import RunConfig
from workers.results import EnvironmentInfo, RankResult, RunOutcome, StepTime, step_totals

API = "/api/v1"
MASK = {
    "kind": "documents",
    "causal": True,
    "sampled": {"distribution": "lognormal", "mean": 256, "max_fraction": 0.25, "seed": 0,
                "multiple_of": 4},
}  # fmt: skip
CELLS = [  # (kernel, balance, world size)
    ("ring", "none", 2),
    ("ring", "ptrr", 2),
    ("allgather_kv", "none", 2),
    ("ulysses", None, 2),
    ("dense", None, 1),
]
SPEC: dict[str, Any] = {
    "name": "documents by balance",
    "base": {"device": "cpu", "num_heads": 4, "head_dim": 32, "dtype": "float32",
             "causal": True, "mode": "train", "iterations": 3, "params": {"mask": MASK}},
    "grid": {"seq_len": [1024, 2048]},
    "zip": {"kernel": [k for k, _, _ in CELLS],
            "params": [{} if b is None else {"balance": b} for _, b, _ in CELLS],
            "world_size": [w for _, _, w in CELLS]},
    "analysis": {"baseline": {"params.balance": "none"}},
}  # fmt: skip
SHARES = {("ring", "none"): (0.3, 0.7), ("ring", "ptrr"): (0.5, 0.5),
          ("allgather_kv", "none"): (0.25, 0.75)}  # fmt: skip
"""Each scheme's share of the mask's pairs per rank (ulysses and dense count none)."""
MATMUL = {"matmul_dtype": "float32", "matmul_size": 1024, "matmul_s": 0.05}
MATMUL_RATE = 2 * 1024**3 / 0.05
"""The node's GEMM probe as workers.matmul_probe stores it, and its rate (2 n^3 / seconds)."""
ENVIRONMENT = EnvironmentInfo(
    hosts=["node-a"], torch="2.13.0+cpu", python="3.11.7", cpu_threads=1,
    **MATMUL, matmul_flops_per_s=MATMUL_RATE,
)  # fmt: skip


def _rank(config: RunConfig, rank: int) -> RankResult:
    """One rank: its kept pairs its scheme's share of the mask's, its times growing with that
    share (and slower for allgather_kv), its steps' compute with it."""
    n = config.seq_len
    pairs = config.num_heads * parse(config.params["mask"], n).pairs(n)
    share = SHARES.get((config.kernel, config.params.get("balance")))
    weight = 1.0 if share is None else 2 * share[rank]
    scale = {"allgather_kv": 1.3, "ulysses": 1.1, "dense": 1.6}.get(config.kernel, 1.0)
    t = 1e-3 * (n / 1024) ** 2 * scale * (0.6 + 0.4 * weight)
    steps = [
        StepTime(iteration=i, phase=phase, step=0, compute_s=0.4 * t * weight * f, wait_s=0.1 * t)
        for i in range(3)
        for phase, f in (("forward", 1.0), ("backward", 2.0))
    ]
    return RankResult(
        rank=rank,
        seq_len=n,
        **timing([t * 0.97, t, t * 1.05], n // config.world_size, 3.5 * 4 * pairs * 32),
        peak_memory_bytes=4096 * n,
        backend="sdpa",
        kept_pairs=None if share is None else round(pairs * share[rank]),
        # the K/V a rank receives, a share of it wasted as its scheme's shares say
        comm_bytes=None if share is None else 4096 * n,
        wasted_comm_bytes=None if share is None else round(4096 * n * (1 - share[rank])),
        forward_s=t / 3,
        backward_s=2 * t / 3,
        steps=steps if config.world_size > 1 else [],
        **step_totals(steps if config.world_size > 1 else []),
    )


def store_documents_sweep(
    client: Any, spec: dict[str, Any] | None = None, failing: str | None = None
) -> int:
    """Submit the sweep (SPEC by default), then finish each run through the write path (the
    runs of kernel `failing` failed)."""
    created = client.post(f"{API}/sweeps", json=spec or SPEC)
    assert created.status_code == 201, created.text
    sweep_id = int(created.json()["id"])
    sm = client.app.state.sessionmaker
    while (claim := leases.claim_next(sm, "documents", 60.0)) is not None:
        config = RunConfig.model_validate(claim.config)
        if config.kernel == failing:
            outcome = RunOutcome(status="failed", error="rank 0: RuntimeError: gloo timed out")
        else:
            ranks = [_rank(config, r) for r in range(config.world_size)]
            outcome = RunOutcome(status="succeeded", ranks=ranks, environment=ENVIRONMENT)
        assert write.finish(sm, claim, completion_from_outcome(outcome))
    return sweep_id


def section_tables(report: str) -> dict[tuple[int, int], list[dict[str, str]]]:
    """report.md's "Packed documents" section as {(length, W): its table's rows as dicts}."""
    part = report.split("## Packed documents: balance and schemes\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[tuple[int, int], list[dict[str, str]]] = {}
    for heading, body in re.findall(r"\*\*([\d,]+ tokens · W=\d+)\*\*\n\n((?:\|.*\n)+)", part):
        length, world = re.fullmatch(r"([\d,]+) tokens · W=(\d+)", heading).groups()  # type: ignore[union-attr]
        lines = [
            [c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
        ]
        header, rows = lines[0], lines[2:]
        tables[(int(length.replace(",", "")), int(world))] = [
            dict(zip(header, r, strict=True)) for r in rows
        ]
    return tables


def imbalance(values: list[float]) -> float:
    """max / mean, recomputed."""
    return max(values) / (sum(values) / len(values))


def recomputed(ranks: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, float | None]:
    """What the section and results.json show of a run, from its raw rank fields: the kept
    pairs' and the step compute's max / mean, the slowest rank's median, and TFLOP/s from the
    kept pairs (4 x head_dim x pairs x batch forward, 2.5x that backward) over the slowest
    rank's forward and backward."""
    kept = [r["kept_pairs"] for r in ranks]
    compute = [r["step_compute_s"] for r in ranks]
    out: dict[str, float | None] = {
        "median_s": max(r["median_s"] for r in ranks),
        "wasted_comm_share": None
        if None in [r["comm_bytes"] for r in ranks]
        else sum(r["wasted_comm_bytes"] for r in ranks) / sum(r["comm_bytes"] for r in ranks),
        "kept_pairs_imbalance": None if None in kept else imbalance(kept),
        "compute_imbalance": None if None in compute else imbalance(compute),
        "kept_forward_tflops_per_s": None,
        "kept_backward_tflops_per_s": None,
        # each rank's FLOP/s (the kernel's own FLOPs over the slowest median) / the probe's rate
        "matmul_fraction": sum(r["flops"] for r in ranks)
        / max(r["median_s"] for r in ranks)
        / config["world_size"]
        / MATMUL_RATE,
    }
    if None not in kept:
        forward = 4 * config["head_dim"] * sum(kept) * config.get("batch_size", 1)
        out["kept_forward_tflops_per_s"] = forward / max(r["forward_s"] for r in ranks) / 1e12
        out["kept_backward_tflops_per_s"] = (
            2.5 * forward / max(r["backward_s"] for r in ranks) / 1e12
        )
    return out
