"""report.md's "Sequence-parallel schemes side by side" section, from results.json rows alone.

For a sweep that runs two or more of the sequence-parallel schemes (the ring kernels, ulysses,
allgather_kv, usp, torch_cp) on several ranks: per length and mode, each scheme's time,
tokens/s, largest peak per rank, exposed-communication share and the maximum length its
max_seq_len search found (same world size, mode and shape), and the fastest scheme. Built from
the rows results.json serves (service.api.results.result_row), so the section can be recomputed
from the download (tests/service/test_sp_schemes_service.py does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SCHEMES = ("ring", "ulysses", "allgather_kv", "usp", "torch_cp")
"""The sequence-parallel schemes the section compares."""
SHAPE = ("world_size", "num_heads", "num_kv_heads", "head_dim", "dtype", "causal", "mode")
"""What must match for two rows to be compared."""


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(f) for f in SHAPE)


def _peak(row: Mapping[str, Any]) -> int | None:
    peaks = row.get("rank_peak_bytes") or []
    return max(peaks) if peaks else row.get("peak_memory_bytes")


def _cells(row: Mapping[str, Any], longest: dict[tuple[Any, ...], int]) -> list[str]:
    max_len = longest.get((*_key(row), row["kernel"]))
    return [
        row["kernel"],
        f"{row['median_s'] * 1e3:,.1f} ms",
        f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "-",
        _mib(_peak(row)),
        _pct(row.get("exposed_comm_share")),
        "-" if max_len is None else f"{max_len:,}",
    ]


def sp_schemes_section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The section's markdown lines ([] unless two schemes ran on several ranks)."""
    ours = [
        r
        for r in rows
        if r.get("kernel") in SCHEMES and r.get("world_size", 1) > 1 and r["status"] == "succeeded"
    ]
    timed = [r for r in ours if r.get("max_seq_len") is None and r.get("median_s")]
    longest = {
        (*_key(r), r["kernel"]): r["max_seq_len"] for r in ours if r.get("max_seq_len") is not None
    }
    if len({r["kernel"] for r in timed}) < 2:
        return []
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in timed:
        length = r.get("measured_seq_len") or r["seq_len"]
        groups.setdefault((*_key(r), length), []).append(r)
    header = ["Seq len", "World", "Mode", "Scheme", "Time", "Tokens/s", "Peak per rank",
              "Exposed comm", "Max length", "Winner"]  # fmt: skip
    body = []
    for key in sorted(groups, key=lambda k: (*(str(x) for x in k[:-1]), k[-1])):
        group = sorted(groups[key], key=lambda r: r["median_s"])
        best = group[0]["median_s"]
        for r in group:
            winner = "**fastest**" if r is group[0] else f"x{r['median_s'] / best:.2f}"
            body.append([f"{key[-1]:,}", str(key[0]), str(key[-2]), *_cells(r, longest), winner])
    return [
        "## Sequence-parallel schemes side by side",
        "",
        "Per length, world size and mode, the schemes that ran with the same heads, head_dim, "
        "dtype and causality, fastest first: time = the slowest rank's median, peak per rank = "
        "the largest rank's, exposed comm = time blocked on communication / time in steps (all "
        "ranks; an all-to-all or all-gather wait counts), max length = the scheme's "
        "max_seq_len search in this sweep under the same shape (its memory budget), winner = "
        "the fastest, or a scheme's time over the fastest's.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
        "",
    ]
