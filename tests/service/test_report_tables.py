"""Every table of seeds 000-003 from one example sweep: the CPU twin of each example is submitted
through the API, measurements are stored as the scheduler stores them (synthetic numbers with a
known answer), and report.md must show the seed's table with those numbers (golden sections).
The numbers are recomputed here from the raw measurement, not read back from the report.

Also: results.json, results.csv, report.md and the dashboard show the same numbers for the
same run (one read model), and a max-length run's tokens/s is batch x answer / median.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from _api_helpers import mark_succeeded
from _results_helpers import timing
from _web_helpers import make_web_app
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.cli.specs import load_specs
from service.core.config import Settings
from service.db.models import Probe, RankResultRow
from service.results.report_format import fmt_bytes, fmt_ms, fmt_num

API = "/api/v1"
MiB = 1 << 20
LOW, HIGH = 0.95, 1.05
"""put() stores each rank's times as median x (LOW, 1, HIGH): three iterations, whose median
interval is their range [LOW x median, HIGH x median] (covering 75%)."""


def timed(t: float) -> str:
    """A time as the baseline table shows it: the median, its interval (ms), 3 iterations."""
    return f"{fmt_ms(t)} ({t * LOW * 1e3:.2f}-{t * HIGH * 1e3:.2f}, n=3)"


def faster(t_base: float, t_run: float, world_ratio: float = 1.0) -> tuple[str, str]:
    """(speedup, efficiency) cells of a run taking t_run against t_base, with the intervals
    from both stored spreads: lo = base_lo / run_hi, hi = base_hi / run_lo."""
    speedup = t_base / t_run
    lo, hi = t_base * LOW / (t_run * HIGH), t_base * HIGH / (t_run * LOW)
    noise = ", within noise" if lo <= 1 <= hi else ""
    w = world_ratio
    return (
        f"{speedup:.2f}x ({lo:.2f}-{hi:.2f}{noise})",
        f"{speedup / w:.0%} ({lo / w:.0%}-{hi / w:.0%})",
    )


@contextmanager
def client_for(database_url: str) -> Iterator[TestClient]:
    """The service's API and dashboard on `database_url` (no scheduler: results are stored)."""
    with TestClient(
        make_web_app(Settings(database_url=database_url)), base_url="http://localhost"
    ) as client:
        yield client


def submit(client: TestClient, example: str, index: int = 0) -> list[dict[str, Any]]:
    """Submit one document of a bundled example; its runs (id order) with their configs."""
    created = client.post(f"{API}/sweeps", json=load_specs(example)[index])
    assert created.status_code == 201, created.text
    sweep_id = created.json()["id"]
    listed = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id", "limit": 500})
    return listed.json()["data"]


def put(
    client: TestClient,
    run_id: int,
    *,
    medians: list[float],
    peaks: list[int],
    measured: int | None = None,
    inputs: int | None = None,
    flops: float = 1e9,
    probes: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> None:
    """Store what a finished run leaves: one rank result per median (at `measured`, default
    the run's length) and the probes of a search."""
    sm = client.app.state.sessionmaker  # type: ignore[attr-defined]
    with sm() as session:
        session: Session
        run = mark_succeeded(session, run_id, "seed")
        length = measured or run.seq_len
        for rank, (median, peak) in enumerate(zip(medians, peaks, strict=True)):
            session.add(
                RankResultRow(
                    run_id=run_id,
                    rank=rank,
                    seq_len=length,
                    **timing([median * LOW, median, median * HIGH], length, flops),
                    peak_memory_bytes=peak,
                    input_memory_bytes=inputs,
                    backend="sdpa-flash-cpu",
                )
            )
        for p in probes:
            session.add(Probe(run_id=run_id, emulated=False, **p))
        session.commit()


def section(md: str, heading: str) -> str:
    """The lines of report.md under `heading` up to the next heading of the same or a higher
    level, blank lines dropped."""
    level = heading.split(" ")[0]
    lines = md.splitlines()
    start = lines.index(heading) + 1
    out = []
    for line in lines[start:]:
        if line.startswith("#") and len(line.split(" ")[0]) <= len(level):
            break
        if line.strip():
            out.append(line)
    return "\n".join(out)


def report(client: TestClient, sweep_id: int) -> str:
    return client.get(f"{API}/sweeps/{sweep_id}/report.md").text


def fit(seq_len: int, time_s: float, peaks: list[int], inputs: int) -> dict[str, Any]:
    return {
        "seq_len": seq_len,
        "outcome": "fit",
        "time_s": time_s,
        "peak_memory_bytes": max(peaks),
        "rank_peak_bytes": peaks,
        "input_memory_bytes": inputs,
    }


def oom(seq_len: int, requested: int, ranks: int = 1) -> dict[str, Any]:
    return {
        "seq_len": seq_len,
        "outcome": "oom",
        "requested_bytes": requested,
        "rank_peak_bytes": [None] * ranks,
        "error": f"CUDA out of memory. Tried to allocate {requested} bytes",
    }


def test_seed_000_max_length_probes_with_memory_after_inputs(database_url: str) -> None:
    """Seed 000, table 1A: length | memory after QKV | peak | result | notes (the failed
    allocation), and the maximum with its time and throughput."""
    with client_for(database_url) as client:
        (run,) = submit(client, "cpu-max-seq-len-1gpu.yaml", 0)
        probes = [
            fit(1024, 0.002, [6 * MiB], MiB // 2),
            fit(2048, 0.006, [12 * MiB], MiB),
            fit(4096, 0.020, [24 * MiB], 2 * MiB),
            oom(8192, 256 * MiB),
        ]
        put(client, run["id"], medians=[0.020], peaks=[24 * MiB], measured=4096, probes=probes)
        md = report(client, run["sweep_id"])
    assert section(md, f"### Run {run['id']}: dense") == (
        "| Seq len | Time | Memory after inputs | Peak memory | Result | Notes |\n"
        "|---|---|---|---|---|---|\n"
        "| 1,024 | 2.00 ms | 512.00 KiB | 6.00 MiB | fit | - |\n"
        "| 2,048 | 6.00 ms | 1.00 MiB | 12.00 MiB | fit | - |\n"
        "| 4,096 | 20.00 ms | 2.00 MiB | 24.00 MiB | fit | - |\n"
        "| 8,192 | - | - | - | OOM | tried to allocate 256.00 MiB |"
    )
    # time, tokens/s and memory per token at the answer, not at the search's start
    tokens_per_s = 1 * 4096 / 0.020
    per_token = 24 * MiB / 4096
    assert (
        f"| dense | 1 | 4,096 | 20.00 ms | {fmt_num(tokens_per_s)} | 24.00 MiB | "
        f"{fmt_bytes(per_token)} | ok (not checked) |" in md
    )


def test_seed_000_block_sparse_time_by_sparsity(database_url: str) -> None:
    """Seed 000, table 1B: lengths in rows, sparsity in columns, time in the cells."""
    with client_for(database_url) as client:
        runs = submit(client, "cpu-sparsity-1gpu.yaml")
        times = {(2048, 1.0): 0.040, (2048, 0.05): 0.004, (4096, 1.0): 0.160, (4096, 0.05): 0.009}
        for r in runs:
            key = (r["seq_len"], r["config"]["params"]["sparsity_ratio"])
            put(client, r["id"], medians=[times[key]], peaks=[8 * MiB])
        md = report(client, runs[0]["sweep_id"])
    assert section(md, "## Time by seq len and sparsity ratio") == (
        "| Seq len | sparsity_ratio=0.05 | sparsity_ratio=1.0 |\n"
        "|---|---|---|\n"
        "| 2,048 | 4.00 ms | 40.00 ms |\n"
        "| 4,096 | 9.00 ms | 160.00 ms |"
    )
    # and each sparse cell against its dense-in-blocks baseline: 10x and 17.78x faster
    against = section(md, "## Against the baseline")
    for seq, base, t in ((2048, 0.040, 0.004), (4096, 0.160, 0.009)):
        line = (
            f"| {seq:,} | sparsity_ratio=1.0 | {timed(base)} | {timed(t)} | {faster(base, t)[0]} |"
        )
        assert line in against, against
    assert "| 10.00x (9.05-11.05) |" in against  # the first line, written out


def test_seed_000_data_parallel_memory_per_gpu(database_url: str) -> None:
    """Seed 000, table 2: length | GPU0 memory | GPU1 memory | result, per probe."""
    with client_for(database_url) as client:
        runs = submit(client, "cpu-max-seq-len-2gpu.yaml", 0)
        dp = next(r for r in runs if r["config"]["parallel"] == "data")
        probes = [
            fit(1024, 0.004, [9 * MiB, 8 * MiB], MiB),
            fit(2048, 0.012, [18 * MiB, 17 * MiB], 2 * MiB),
            oom(4096, 96 * MiB, ranks=2),
        ]
        put(client, dp["id"], medians=[0.012, 0.011], peaks=[18 * MiB, 17 * MiB], measured=2048,
            probes=probes)  # fmt: skip
        md = report(client, dp["sweep_id"])
    label = "dense · W=2 · data-parallel"
    assert section(md, f"### Run {dp['id']}: {label}") == (
        "| Seq len | Time | Memory after inputs | Peak rank 0 | Peak rank 1 | Result | Notes |\n"
        "|---|---|---|---|---|---|---|\n"
        "| 1,024 | 4.00 ms | 1.00 MiB | 9.00 MiB | 8.00 MiB | fit | - |\n"
        "| 2,048 | 12.00 ms | 2.00 MiB | 18.00 MiB | 17.00 MiB | fit | - |\n"
        "| 4,096 | - | - | - | - | OOM | tried to allocate 96.00 MiB |"
    )


def _dp_sweep(client: TestClient) -> list[dict[str, Any]]:
    """cpu-dp-vs-ring-2gpu.yaml with times: W=1 t, data-parallel 0.6 t (rank 1 slower), ring
    0.7 t; forward t = 1 ms per 1K tokens squared, train 3.5x."""
    runs = submit(client, "cpu-dp-vs-ring-2gpu.yaml")
    for r in runs:
        c = r["config"]
        t = (c["seq_len"] / 1024) ** 2 * 1e-3 * (3.5 if c["mode"] == "train" else 1.0)
        if c["world_size"] == 1:
            put(client, r["id"], medians=[t], peaks=[40 * MiB])
        elif c["parallel"] == "data":
            put(client, r["id"], medians=[0.55 * t, 0.6 * t], peaks=[22 * MiB, 21 * MiB])
        else:
            put(client, r["id"], medians=[0.7 * t, 0.65 * t], peaks=[15 * MiB, 15 * MiB])
    return runs


def test_seed_001_002_data_parallel_speedup(database_url: str) -> None:
    """Seeds 001 and 002: single-GPU time | multi-GPU time | speedup for every length, and the
    speedup equals t(W=1) / t(W=2) from results.json."""
    with client_for(database_url) as client:
        runs = _dp_sweep(client)
        sweep_id = runs[0]["sweep_id"]
        md = report(client, sweep_id)
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
    against = section(md, "## Against the baseline")
    key = {(r["seq_len"], r["mode"], r["world_size"], r["parallel"]): r for r in rows}
    for seq in (1024, 2048, 4096, 8192):
        one = key[(seq, "forward", 1, "sequence")]
        two = key[(seq, "forward", 2, "data")]
        speedup = one["median_s"] / two["median_s"]
        assert two["speedup"] == pytest.approx(speedup) == pytest.approx(1 / 0.6)
        assert two["efficiency"] == pytest.approx(speedup / 2)
        x, eff = faster(one["median_s"], two["median_s"], 2)
        assert (
            f"| dense · W=2 · data-parallel · forward | {seq:,} | W=1 | "
            f"{timed(one['median_s'])} | {timed(two['median_s'])} | {x} | "
            f"40.00 MiB | 22.00 MiB | 0.55x | {eff} |" in against
        ), against
    # seed 002's memory distribution: each rank's peak in its own column
    assert "| Peak rank 0 | Peak rank 1 |" in md
    assert "| 22.00 MiB | 21.00 MiB |" in md


def test_seed_003_dilation_impact_and_max_tokens_per_world_size(database_url: str) -> None:
    """Seed 003, tables 1 and 3: max tokens | throughput at max | dilation impact (against the
    single segment without dilation), on 1 and 2 ranks."""
    with client_for(database_url) as client:
        runs = submit(client, "cpu-dilated-max-len-1-2gpu.yaml")
        answers = {((1024,), (1,)): (8192, 0.90), ((1024,), (2,)): (8192, 0.155)}
        answers |= {((256, 512), (1, 2)): (6144, 0.14), ((256, 512, 1024), (1, 2, 4)): (6144, 0.12)}
        for r in runs:
            p = r["config"]["params"]
            answer, t = answers[(tuple(p["segment_lengths"]), tuple(p["dilation_rates"]))]
            w = r["world_size"]
            answer *= w  # two ranks hold twice the tokens
            probes = [fit(answer, t, [60 * MiB] * w, MiB), oom(answer + 2048, MiB, w)]
            put(client, r["id"], medians=[t] * w, peaks=[60 * MiB] * w, measured=answer,
                probes=probes)  # fmt: skip
        md = report(client, runs[0]["sweep_id"])
    table = section(md, "## Maximum length against the baseline")
    base = 8192 / 0.90
    for label, answer, t in [
        ("dilation_rates=[2] · segment_lengths=[1024] · W=1", 8192, 0.155),
        ("dilation_rates=[1,2] · segment_lengths=[256,512] · W=1", 6144, 0.14),
        ("dilation_rates=[1,2,4] · segment_lengths=[256,512,1024] · W=1", 6144, 0.12),
    ]:
        impact = (answer / t) / base
        assert (
            f"| ring_dilated · {label} | segment_lengths=[1024], dilation_rates=[1] | 8,192 | "
            f"{answer:,} | {answer / 8192:.2f}x | {fmt_num(base)} | {fmt_num(answer / t)} | "
            f"{impact:.2f}x ({impact * LOW / HIGH:.2f}-{impact * HIGH / LOW:.2f}) | - |" in table
        ), table
    # table 3: max tokens per world size, in the maximum-length table
    maxlen = section(md, "## Maximum sequence length")
    assert re.search(r"\| ring_dilated · dilation_rates=\[1\] · segment_lengths=\[1024\] · "
                     r"W=2 \| 2 \| 16,384 \|", maxlen), maxlen  # fmt: skip


def test_results_json_csv_report_and_dashboard_show_the_same_numbers(database_url: str) -> None:
    with client_for(database_url) as client:
        runs = _dp_sweep(client)
        sweep_id = runs[0]["sweep_id"]
        (search,) = submit(client, "cpu-max-seq-len-1gpu.yaml", 0)
        probes = [fit(4096, 0.03, [24 * MiB], MiB), fit(5120, 0.05, [30 * MiB], MiB)]
        put(client, search["id"], medians=[0.05], peaks=[30 * MiB], measured=5120,
            probes=probes)  # fmt: skip
        as_json = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        as_csv = list(
            csv.DictReader(io.StringIO(client.get(f"{API}/sweeps/{sweep_id}/results.csv").text))
        )
        md = report(client, sweep_id)
        dash = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()["rows"]
        html = client.get(f"/sweeps/{sweep_id}").text
        searched = client.get(f"{API}/sweeps/{search['sweep_id']}/results.json").json()[0]
    assert "=None" not in md and "=None" not in html
    by_csv = {int(r["run_id"]): r for r in as_csv}
    by_dash = {r["run_id"]: r for r in dash}
    results = section(md, "## Results per run and sequence length")
    for row in as_json:
        c, d = by_csv[row["run_id"]], by_dash[row["run_id"]]
        for key in ("median_s", "tokens_per_s", "tflops_per_s", "peak_memory_bytes", "speedup",
                    "memory_ratio", "efficiency"):  # fmt: skip
            if row[key] is None:
                assert c[key] == "" and d[key] is None, key
            else:
                assert float(c[key]) == pytest.approx(row[key]), key
                assert d[key] == pytest.approx(row[key]), key
        assert c["rank_peak_bytes"] == ";".join(map(str, row["rank_peak_bytes"]))
        assert d["label"] == row["label"] and d["baseline"] == row["baseline"]
        # the report's line for this run carries the same numbers, formatted
        line = next(
            x for x in results.splitlines()
            if x.startswith(f"| {row['label']} | {row['seq_len']:,} |")
        )  # fmt: skip
        assert f"| {fmt_ms(row['median_s'])} |" in line
        assert f"| {fmt_num(row['tokens_per_s'])} |" in line
    # a max-length run's tokens/s is batch x answer / median (not x the search's start)
    assert searched["measured_seq_len"] == searched["max_seq_len"] == 5120
    assert searched["tokens_per_s"] == pytest.approx(1 * 5120 / 0.05)
    assert searched["seq_len"] == 1024  # the start, kept as the cell's length


def test_seed_003_time_throughput_and_memory_per_gpu_at_two_ranks(database_url: str) -> None:
    """Seed 003, table 2: sequence | configuration | time | throughput | memory per GPU, at W=2,
    with the correctness check's error and the length it ran at beside the outcome."""
    with client_for(database_url) as client:
        runs = submit(client, "cpu-dilated-1-2gpu.yaml")
        two = [r for r in runs if r["world_size"] == 2]
        for r in two:
            t = r["seq_len"] / 2048 * 0.01
            put(client, r["id"], medians=[t, 0.9 * t], peaks=[20 * MiB, 19 * MiB], inputs=MiB)
        sm = client.app.state.sessionmaker  # type: ignore[attr-defined]
        with sm() as session:
            for rr in session.query(RankResultRow).all():
                rr.max_abs_error, rr.check_seq_len = 3e-6, 128
            session.commit()
        md = report(client, two[0]["sweep_id"])
    results = section(md, "## Results per run and sequence length")
    label = "ring_dilated · dilation_rates=[2] · segment_lengths=[2048] · W=2"
    t = 4096 / 2048 * 0.01
    assert (
        f"| {label} | 4,096 | 2 | {fmt_ms(t)} | {fmt_ms(0.95 * t)} - {fmt_ms(1.05 * t)} | "
        f"{fmt_num(4096 / t)} |" in results
    ), results
    line = next(x for x in results.splitlines() if x.startswith(f"| {label} | 4,096 |"))
    per_token = 20 * MiB / 2048  # the largest rank's peak over the 2,048 tokens it holds
    assert line.endswith(
        f"| 1.00 MiB | 20.00 MiB | 19.00 MiB | {fmt_bytes(per_token)} | "
        "ok (max abs err 3.0e-06 at 128) |"
    ), line
