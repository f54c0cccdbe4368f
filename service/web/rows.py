"""Flat result rows for the dashboard: one dict per run with its headline metrics.

Built from the ORM objects, never from guesses: a metric a run did not measure is None.
"""

from __future__ import annotations

import json
from statistics import fmean
from typing import Any

from service.db.models import Environment, ProbeOutcome, Run

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}

# Config fields that may tell two series of one sweep apart (besides kernel, params, world size).
SERIES_FIELDS = ("dtype", "mode", "causal", "parallel", "num_heads", "head_dim", "batch_size")

# Fields that name or bound a run without changing what it measures: two sweeps' cells match
# (compare page) when their configs are equal once these are dropped.
NOT_MEASURED_FIELDS = frozenset(
    {"name", "tags", "label", "timeout_s", "dist_timeout_s", "max_attempts"}
)


def config_key(config: dict[str, Any]) -> str:
    """The canonical JSON of a config without NOT_MEASURED_FIELDS: the compare page's cell key."""
    kept = {k: v for k, v in config.items() if k not in NOT_MEASURED_FIELDS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def device_name(env: Environment | None, config: dict[str, Any]) -> str | None:
    """The device a run ran on: the first GPU's name, 'CPU' for a run without GPUs, else None."""
    if env is None:
        return None
    gpus = env.gpus or []
    if gpus:
        first = gpus[0]
        if isinstance(first, dict):
            return str(first.get("name") or first.get("model") or "unknown GPU")
        return str(first)
    return "CPU"


def variant(kernel: str, params: dict[str, Any]) -> str:
    """The kernel and its parameters as a short label, e.g. 'dilated segment_lengths=2048,4096'."""
    if not params:
        return kernel
    parts = []
    for key in sorted(params):
        value = params[key]
        if isinstance(value, list | tuple):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, dict):
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return f"{kernel} " + " ".join(parts)


def run_row(run: Run) -> dict[str, Any]:
    """The headline metrics of one run.

    time_s is the slowest rank's median (a ring step ends when its last rank does);
    tokens_per_s counts every token of the batch over that time; flops_per_s_per_rank is the
    ranks' mean; peak_memory_bytes is the largest rank's peak.
    """
    cfg = run.config or {}
    ranks = list(run.rank_results)
    batch = int(cfg.get("batch_size", 1))
    time_s = max((r.median_s for r in ranks), default=None)
    fits = [p.seq_len for p in run.probes if p.outcome == ProbeOutcome.fit]
    return {
        "run_id": run.id,
        "sweep_id": run.sweep_id,
        "kernel": run.kernel,
        "params": cfg.get("params", {}),
        "variant": variant(run.kernel, cfg.get("params", {})),
        "seq_len": run.seq_len,
        "world_size": run.world_size,
        "dtype": run.dtype,
        "mode": run.mode,
        "causal": run.causal,
        "parallel": cfg.get("parallel", "sequence"),
        "batch_size": batch,
        "num_heads": int(cfg.get("num_heads", 8)),
        "head_dim": int(cfg.get("head_dim", 64)),
        "status": str(run.status.value if hasattr(run.status, "value") else run.status),
        "attempts": run.attempts,
        "device": device_name(run.environment, cfg),
        "backend": ranks[0].backend if ranks else None,
        "time_s": time_s,
        "tokens_per_s": (batch * run.seq_len / time_s) if time_s else None,
        "flops_per_s_per_rank": fmean(r.flops_per_s for r in ranks) if ranks else None,
        "peak_memory_bytes": max((r.peak_memory_bytes for r in ranks), default=None),
        "max_abs_error": max(
            (r.max_abs_error for r in ranks if r.max_abs_error is not None), default=None
        ),
        "max_seq_len": max(fits) if fits else None,
        "probes": [
            {
                "seq_len": p.seq_len,
                "outcome": str(p.outcome.value if hasattr(p.outcome, "value") else p.outcome),
                "peak_memory_bytes": p.peak_memory_bytes,
                "time_s": p.time_s,
                "emulated": p.emulated,
            }
            for p in run.probes
        ],
        "error": run.error,
        "config_key": config_key(cfg),
    }


def local_tokens(row: dict[str, Any]) -> int:
    """Tokens one rank holds: its share of the sequence (sequence) or of the batch (data)."""
    w = row["world_size"]
    if row["parallel"] == "data":
        return (row["batch_size"] // w) * row["seq_len"]
    return row["batch_size"] * (row["seq_len"] // w)


def memory_floor_bytes(row: dict[str, Any]) -> int | None:
    """Forward floor per rank: q, k, v, out (4*h*d*bytes) plus the fp32 lse (4*h) per token."""
    bpe = BYTES_PER_ELEMENT.get(row["dtype"])
    if bpe is None:
        return None
    h, d = row["num_heads"], row["head_dim"]
    return (4 * h * d * bpe + 4 * h) * local_tokens(row)
