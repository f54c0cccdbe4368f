"""The timing fields every planted rank result carries, computed one way: a workers RankResult
and a database RankResultRow name them alike."""

from __future__ import annotations

from typing import Any


def timing(times: list[float], tokens: int, flops: float) -> dict[str, Any]:
    """times_s .. flops_per_s of a rank timed `times` (ascending, the median their middle
    one): p10 and p90 their first and last, tokens (the rank's) and FLOPs per second at the
    median."""
    median = times[len(times) // 2]
    return {
        "times_s": times,
        "median_s": median,
        "p10_s": times[0],
        "p90_s": times[-1],
        "tokens_per_s": tokens / median,
        "flops": flops,
        "flops_per_s": flops / median,
    }
