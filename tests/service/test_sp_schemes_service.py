"""ulysses, allgather_kv and usp through the service: bad heads or degrees are a 422 naming the
field, and the CPU study (examples/cpu-sp-schemes.yaml, cut down) runs on a real local Ray gang
of 4 ranks: every scheme gated, its bytes per rank, compute rate and (usp) Ulysses groups from
its ranks' raw figures, report.md's schemes section and its predicted times recomputed from
results.json, the dashboard's chart, and the max_seq_len search."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _api_helpers import api_client
from _gang_helpers import run_queue

from service.cli.specs import load_specs
from service.results.rows_build import ulysses_groups
from service.results.schemes import all_to_all_bytes, predicted_s, sp_schemes_section

API = "/api/v1"
BASE = {
    "num_heads": 4,
    "head_dim": 8,
    "world_size": 2,
    "parallel": "sequence",
    "device": "cpu",
    "causal": True,
    "warmup": 1,
    "iterations": 2,
    "timeout_s": 300,
    "correctness_check": True,
}


def _spec(kernel: str, **base: Any) -> dict[str, Any]:
    return {"name": kernel, "base": {**BASE, "kernel": kernel, "seq_len": 256, **base}}


def test_bad_heads_and_degrees_are_422_naming_the_field(database_url: str) -> None:
    with api_client(database_url) as client:
        cases = [
            (_spec("ulysses", num_heads=3), ["body", "base", "num_heads"], "world_size 2"),
            (
                _spec("ulysses", world_size=4, num_kv_heads=3, num_heads=12),
                ["body", "base", "num_kv_heads"],
                "replicated",
            ),
            (
                _spec("usp", params={"ulysses_degree": 4}),
                ["body", "base", "params", "ulysses_degree"],
                "must divide world_size 2",
            ),
            (
                _spec("ulysses", params={"inner": "dense", "window": 4}),
                ["body", "base", "params", "window"],
                "not a parameter of inner kernel 'dense'",
            ),
            (
                _spec("allgather_kv", params={"layout": "striped"}),
                ["body", "base", "params", "layout"],
                "contiguous, zigzag",
            ),
        ]
        for spec, loc, words in cases:
            r = client.post(f"{API}/sweeps", json=spec)
            assert r.status_code == 422, r.text
            (err,) = r.json()["detail"]
            assert err["loc"] == loc and words in err["msg"], err


def _cut_down_study() -> list[dict[str, Any]]:
    """examples/cpu-sp-schemes.yaml at its smallest: the four schemes at W=4 (heads and head_dim
    cut, 128 tokens, train only, one iteration), and the max_seq_len search for the ring and
    allgather_kv only, over 128..512 tokens under a budget the ring fits at 512 and allgather_kv,
    whose K/V per rank grow with the whole length, does not."""
    study, search = load_specs("cpu-sp-schemes.yaml")
    small = {"num_heads": 4, "head_dim": 8, "warmup": 1, "iterations": 1, "timeout_s": 300}
    study["base"] |= small | {"correctness_check": True}
    study["grid"] |= {"seq_len": [128], "mode": ["train"]}
    search["base"] |= small | {"memory_budget_bytes": 480_000}
    search["grid"] |= {"kernel": ["ring", "allgather_kv"]}
    search["search"] = {"start": 128, "max": 512, "granularity": 128}
    return [study, search]


def _check_run(client: Any, row: dict[str, Any]) -> None:
    """A gated run whose bytes per rank and Ulysses groups come from its ranks' raw figures."""
    assert row["max_abs_error"] is not None and row["max_abs_error"] < 1e-4, row
    assert 0 <= row["exposed_comm_share"] < 1
    ranks = client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
    received = [r["step_received_bytes"] for r in ranks]
    assert min(received) > 0
    assert row["comm_bytes_per_rank"] == max(received) / row["iterations"]
    flops = sum(r["flops"] for r in ranks) * row["iterations"]
    rate = flops / sum(r["step_compute_s"] for r in ranks)
    assert row["step_flops_per_s_per_rank"] == pytest.approx(rate)
    nodes = {r["node"] for r in ranks}
    assert len(nodes) == 1 and None not in nodes  # one local Ray node
    if row["kernel"] == "usp":  # U = 2: ranks 0-1 and 2-3, each within the node
        (node,) = nodes
        assert row["ulysses_groups"] == f"ranks 0-1 on {node}; ranks 2-3 on {node}"
        assert "ranks 0-1 on" in client.get(f"/runs/{row['run_id']}").text
    else:
        assert row["ulysses_groups"] is None


def _predicted(row: dict[str, Any]) -> float:
    """The section's predicted time, recomputed from results.json's figures by hand."""
    compute = row["flops_per_s_per_rank"] * row["median_s"] / row["step_flops_per_s_per_rank"]
    link = row["link_probe_bytes_per_s"]
    comm = row["comm_bytes_per_rank"] / link
    if row["kernel"] == "ring":
        return max(compute, comm)
    if row["kernel"] == "usp":  # q, k, v, out and their gradients: half of each leaves a rank
        n = row["measured_seq_len"] // row["world_size"]
        a2a = 2 * 4 * n * row["num_heads"] * row["head_dim"] * 4 / 2 / link
        return a2a + max(compute, comm - a2a)
    return compute + comm


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_the_cpu_study_runs_through_the_service(tmp_path: Path, ray_session: Any) -> None:
    with api_client(f"sqlite:///{tmp_path / 'sp.db'}") as client:
        ids = []
        for spec in _cut_down_study():
            created = client.post(f"{API}/sweeps", json=spec)
            assert created.status_code == 201, created.text
            ids.append(created.json()["id"])
        run_queue(client.app.state.sessionmaker)
        rows = client.get(f"{API}/sweeps/{ids[0]}/results.json").json()
        assert [r["status"] for r in rows] == ["succeeded"] * 4, [r["error"] for r in rows]
        assert sorted(r["kernel"] for r in rows) == ["allgather_kv", "ring", "ulysses", "usp"]
        for row in rows:
            _check_run(client, row)
        # report.md's schemes section, recomputed from results.json
        section = sp_schemes_section(rows)
        assert section[0] == "## Sequence-parallel schemes side by side"
        table = [line for line in section if line.startswith("| 128 | 4 | train |")]
        assert len(table) == 4 and sum("**fastest**" in line for line in table) == 1
        for row in rows:
            (line,) = [t for t in table if f"| {row['kernel']} |" in t]
            assert f"| {_predicted(row) * 1e3:,.1f} ms |" in line, line
            assert f"| {row['comm_bytes_per_rank'] / 2**10:,.1f} KiB |" in line, line
        report = client.get(f"{API}/sweeps/{ids[0]}/report.md").text
        assert "\n".join(section) in report
        # the dashboard's chart: tokens/s against length, one line per scheme; a sweep of the
        # schemes alone draws it once, as the throughput chart (no second chart of the same)
        figures = client.get(f"/sweeps/{ids[0]}/dashboard.json").json()["figures"]
        assert "chart-sp-schemes" not in figures, list(figures)
        chart = figures["chart-throughput"]
        names = sorted(t["name"].split(" · ")[0] for t in chart["data"])
        assert names == sorted(r["kernel"] for r in rows), names
        assert chart["layout"]["yaxis"]["title"]["text"] == "throughput (tokens/s)"
        # the search: each scheme's longest length under the budget
        searched = client.get(f"{API}/sweeps/{ids[1]}/results.json").json()
        assert [r["status"] for r in searched] == ["succeeded"] * 2, searched
        longest = {r["kernel"]: r["max_seq_len"] for r in searched}
        # measured here: at 512 tokens the ring's peak per rank 404 KiB, allgather_kv's 571 KiB
        assert longest["allgather_kv"] < longest["ring"] == 512, longest


def test_the_schemes_section_ranks_each_length_and_shows_each_searched_maximum() -> None:
    shape = {"world_size": 4, "num_heads": 8, "num_kv_heads": 8, "head_dim": 32}
    shape |= {"dtype": "float32", "causal": True, "mode": "train", "status": "succeeded"}

    def row(kernel: str, median_s: float | None, max_seq_len: int | None = None) -> dict:
        return {**shape, "kernel": kernel, "scheme": kernel, "seq_len": 2048,
                "measured_seq_len": 2048,
                "median_s": median_s, "tokens_per_s": None if median_s is None else 2048 / median_s,
                "rank_peak_bytes": [3 << 20, 5 << 20], "exposed_comm_share": 0.25,
                "max_seq_len": max_seq_len}  # fmt: skip

    rows = [row("ring", 0.4), row("ulysses", 0.2), row("allgather_kv", None, 8192)]
    assert sp_schemes_section(rows[:1] + rows[2:]) == []  # one timed scheme: nothing to compare
    section = sp_schemes_section([*rows, {**row("usp", 0.1), "world_size": 1}])
    table = [line for line in section if line.startswith("| 2,048")]
    assert table == [
        "| 2,048 | 4 | train | ulysses | 200.0 ms | - | 10,240 | 5.0 MiB | 25.0% | - | - | "
        "**fastest** |",
        "| 2,048 | 4 | train | ring | 400.0 ms | - | 5,120 | 5.0 MiB | 25.0% | - | - | x2.00 |",
    ]
    rows.append(row("allgather_kv", 0.3))
    (line,) = [x for x in sp_schemes_section(rows) if "| allgather_kv |" in x]
    assert line.endswith("| 8,192 | x1.50 |")


def test_the_predicted_times_and_where_they_part_ways() -> None:
    # 1 GFLOP per rank at 10 GFLOP/s: 0.1 s of compute; 50 MB over 1 GB/s: 0.05 s of transfers
    shape = {"world_size": 4, "num_heads": 8, "num_kv_heads": 8, "head_dim": 32,
             "batch_size": 1, "dtype": "float32", "causal": True, "mode": "train",
             "status": "succeeded", "seq_len": 4096, "measured_seq_len": 4096, "params": "{}",
             "step_flops_per_s_per_rank": 1e10, "comm_bytes_per_rank": 5e7,
             "link_probe_bytes_per_s": 1e9}  # fmt: skip

    def row(kernel: str, median_s: float, **more: Any) -> dict[str, Any]:
        flops_rate = 1e9 / median_s  # every row computes 1 GFLOP per rank
        return {**shape, "kernel": kernel, "scheme": kernel, "median_s": median_s,
                "tokens_per_s": 1.0,
                "flops_per_s_per_rank": flops_rate, **more}  # fmt: skip

    ring, ulysses = row("ring", 0.11), row("ulysses", 0.3)
    usp = row("usp", 0.11, params='{"ulysses_degree": 2}')
    assert predicted_s(ring) == pytest.approx(0.1)  # overlapped: max(0.1, 0.05)
    assert predicted_s(ulysses) == pytest.approx(0.15)  # blocking: 0.1 + 0.05
    # usp's all-to-alls: 8 of 1,024 tokens x 8 heads x 32 x 4 bytes, half of each received
    a2a = 8 * 1024 * 8 * 32 * 4 / 2
    assert all_to_all_bytes(usp) == a2a
    assert predicted_s(usp) == pytest.approx(a2a / 1e9 + max(0.1, 0.05 - a2a / 1e9))
    assert predicted_s({**ring, "link_probe_bytes_per_s": None}) is None
    section = sp_schemes_section([ring, ulysses, usp])
    (line,) = [x for x in section if "| ring |" in x]
    assert "| 110.0 ms | 100.0 ms |" in line and "| 47.7 MiB |" in line
    parted = [x for x in section if x.startswith("- ")]
    assert parted == ["- ulysses at 4,096 tokens, W=4, train: measured 300.0 ms, predicted "
                      "150.0 ms (x2.00)"]  # fmt: skip
    close = sp_schemes_section([ring, row("ulysses", 0.16)])
    assert "Every prediction is within 25% of its measured time." in close


def test_ulysses_groups_name_their_nodes_and_a_group_across_nodes() -> None:
    def row(nodes: list[str], degree: int) -> Any:
        ranks = [SimpleNamespace(rank=r, node=n) for r, n in enumerate(nodes)]
        params = {"ulysses_degree": degree}
        return SimpleNamespace(kernel="usp", params=params, world_size=len(nodes), ranks=ranks)

    two_nodes = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert ulysses_groups(row(two_nodes, 2)) == "ranks 0-1 on 10.0.0.1; ranks 2-3 on 10.0.0.2"
    assert ulysses_groups(row(two_nodes, 4)) == "ranks 0-3 on 10.0.0.1, 10.0.0.2 (across 2 nodes)"
    assert ulysses_groups(row([*two_nodes[:3], None], 2)) is None  # stored before 0015
    assert ulysses_groups(SimpleNamespace(kernel="ring", ranks=[])) is None
