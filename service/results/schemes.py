"""report.md's "Sequence-parallel schemes side by side" section, from results.json rows alone.

For a sweep that runs two or more of the sequence-parallel schemes (the ring kernels, ulysses,
allgather_kv, usp, torch_cp) on several ranks: per length and mode, each scheme's time, the
time predicted for it, tokens/s, largest peak per rank, exposed-communication share, bytes
moved per rank, the maximum length its max_seq_len search found (same world size, mode and
shape), and the fastest scheme; then where prediction and measurement part ways. Built from the
rows results.json serves (service.results.report.result_row), so the section can be recomputed
from the download (tests/service/test_sp_schemes_service.py does).

The prediction (`predicted_s`) uses the run's own measurements only: its compute time C is a
rank's FLOPs per iteration over the rank's compute rate in its steps
(step_flops_per_s_per_rank), its communication time M the bytes a rank moved per iteration
(comm_bytes_per_rank) over the probed link's bandwidth (link_probe_bytes_per_s), and each
scheme's overlap (its KernelSpec's `comm_overlap`) decides how they add up: the ring posts
the next K/V hop before computing, so its transfers hide behind compute (max(C, M)); ulysses'
all-to-alls and allgather_kv's gather and reduce-scatter block (C + M); usp's all-to-alls
block and its ring overlaps (A + max(C, M - A), A its all-to-all bytes, known from the shapes,
over the link).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attention
from attention import CommOverlap
from service.units import EMPTY, KIB, MIB, nbytes, percent

PLUGIN_SCHEMES = ("torch_cp",)
"""Plugin kernels the section compares too: named here, since a plugin may not load where the
report is built (torch_cp needs CUDA) while its rows are still there."""


def _exact_schemes() -> tuple[str, ...]:
    """The built-in sequence-parallel schemes of exact attention: the kernels that declare a
    communication overlap and whose single-process twin is the exact dense kernel."""
    dense = attention.exact_dense()
    return tuple(
        name
        for name, spec in attention.KERNELS.items()
        if spec.plugin is None and spec.comm_overlap is not None and spec.twin == dense
    )


SCHEMES = (*_exact_schemes(), *PLUGIN_SCHEMES)
"""The sequence-parallel schemes the section compares (ring, ulysses, allgather_kv, usp,
torch_cp)."""
SHAPE = ("world_size", "num_heads", "num_kv_heads", "head_dim", "dtype", "causal", "mode")
"""What must match for two rows to be compared."""


PART_WAYS = 0.25
"""A prediction more than this far from the measured time (either way) is listed."""
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _params(row: Mapping[str, Any]) -> dict[str, Any]:
    params = row.get("params") or {}
    return json.loads(params) if isinstance(params, str) else dict(params)


def all_to_all_bytes(row: Mapping[str, Any]) -> float:
    """usp: the bytes a rank receives per iteration in its all-to-alls: q, k, v and the output
    forward (train: the output gradient, dq, dk, dv too), (U - 1) / U of each, K/V with their
    heads replicated up to U when fewer."""
    u = int(_params(row).get("ulysses_degree", 2))
    n = row["batch_size"] * (row.get("measured_seq_len") or row["seq_len"]) // row["world_size"]
    kv = row.get("num_kv_heads") or row["num_heads"]
    kv = u if kv < u else kv
    one_way = (
        n * row["head_dim"] * BYTES[row["dtype"]] * (u - 1) / u * (2 * row["num_heads"] + 2 * kv)
    )
    return one_way * (2 if row["mode"] == "train" else 1)


def predicted_s(row: Mapping[str, Any]) -> float | None:
    """Seconds per iteration predicted from the run's compute rate, link and bytes (see the
    module docstring); None when a number is missing or the scheme's overlap is not known."""
    need = ("median_s", "flops_per_s_per_rank", "step_flops_per_s_per_rank",
            "comm_bytes_per_rank", "link_probe_bytes_per_s")  # fmt: skip
    if any(not row.get(k) for k in need):
        return None
    compute = row["flops_per_s_per_rank"] * row["median_s"] / row["step_flops_per_s_per_rank"]
    comm = row["comm_bytes_per_rank"] / row["link_probe_bytes_per_s"]
    spec = attention.KERNELS.get(row["kernel"])
    overlap = None if spec is None else spec.comm_overlap
    if overlap is CommOverlap.OVERLAPPED:
        return max(compute, comm)
    if overlap is CommOverlap.BLOCKING:
        return compute + comm
    if overlap is CommOverlap.ALL_TO_ALL_THEN_RING:
        a2a = all_to_all_bytes(row) / row["link_probe_bytes_per_s"]
        return a2a + max(compute, comm - a2a)
    return None


def _mib(n: float | None) -> str:
    """MiB, or KiB below one MiB (a tiny run's bytes would read 0.0 MiB)."""
    return nbytes(n, units=(MIB, KIB), digits=1, grouped=True)


def _pct(x: float | None) -> str:
    return percent(x, 1, empty=EMPTY)


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(f) for f in SHAPE)


def _peak(row: Mapping[str, Any]) -> int | None:
    peaks = row.get("rank_peak_bytes") or []
    return max(peaks) if peaks else row.get("peak_memory_bytes")


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f} ms"


def _cells(row: Mapping[str, Any], longest: dict[tuple[Any, ...], int]) -> list[str]:
    max_len = longest.get((*_key(row), row["scheme"]))
    return [
        row["scheme"],
        _ms(row["median_s"]),
        _ms(predicted_s(row)),
        f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "-",
        _mib(_peak(row)),
        _pct(row.get("exposed_comm_share")),
        _mib(row.get("comm_bytes_per_rank")),
        "-" if max_len is None else f"{max_len:,}",
    ]


def part_ways(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per row whose predicted time is more than PART_WAYS from its measured one;
    a line saying so when every prediction is within it (none without any prediction)."""
    out, predicted = [], 0
    for r in rows:
        guess = predicted_s(r)
        if guess is None:
            continue
        predicted += 1
        ratio = r["median_s"] / guess
        if abs(ratio - 1) > PART_WAYS:
            length = r.get("measured_seq_len") or r["seq_len"]
            out.append(
                f"- {r['scheme']} at {length:,} tokens, W={r['world_size']}, {r['mode']}: "
                f"measured {_ms(r['median_s'])}, predicted {_ms(guess)} (x{ratio:.2f})"
            )
    if not predicted:
        return []
    if not out:
        return [f"Every prediction is within {PART_WAYS:.0%} of its measured time.", ""]
    return [
        f"Prediction and measurement part ways (more than {PART_WAYS:.0%} apart) for:",
        "",
        *out,
        "",
        "What the prediction leaves out: time outside the steps (the call's setup and shape "
        "check), waiting for a slower rank (counted as communication when it happens at a "
        "transfer), and links that share one host's cores or memory bandwidth at once (the "
        "probe measures one link alone).",
        "",
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
        (*_key(r), r["scheme"]): r["max_seq_len"] for r in ours if r.get("max_seq_len") is not None
    }
    if len({r["kernel"] for r in timed}) < 2:
        return []
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in timed:
        length = r.get("measured_seq_len") or r["seq_len"]
        groups.setdefault((*_key(r), length), []).append(r)
    header = ["Seq len", "World", "Mode", "Scheme", "Time", "Predicted", "Tokens/s",
              "Peak per rank", "Exposed comm", "Bytes per rank", "Max length",
              "Winner"]  # fmt: skip
    body, in_order = [], []
    keys = sorted(groups, key=lambda k: (*(str(x) for x in k[:-1]), k[-1]))
    for key in keys:
        group = sorted(groups[key], key=lambda r: (r["median_s"], r["scheme"]))
        in_order += group
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
        "ranks; an all-to-all or all-gather wait counts), bytes per rank = moved per "
        "iteration (the most any rank received), predicted = from the run's own compute "
        "rate in its steps, probed link and bytes, with the scheme's overlap (ring: "
        "transfers hidden behind compute; ulysses, allgather_kv: blocking; usp: blocking "
        "all-to-alls, overlapped ring), max length = the scheme's max_seq_len search in this "
        "sweep under the same shape (its memory budget), winner = the fastest, or a scheme's "
        "time over the fastest's.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
        "",
        *part_ways(in_order),
    ]
