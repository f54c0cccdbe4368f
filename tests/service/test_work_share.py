"""Each rank's share of the work as a researcher reads it: report.md's "Packed documents: balance
and schemes" section and results.json's fields, every number recomputed from the runs' raw rank
fields (the API's rank_results), % of ideal from the W=1 run's own median; the run page says the
same; a sweep without a documents mask has no such section.

The sweep is stored through the API and the scheduler's write path (tests/_documents_helpers.py),
on SQLite and Postgres where the pairing is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _documents_helpers import (
    API,
    CELLS,
    SPEC,
    imbalance,
    recomputed,
    section_tables,
    store_documents_sweep,
)
from test_result_goldens import SPECS, _store

from service.results import work_share
from workers.results import RankResult


def _read(
    url: str, spec: dict[str, Any] | None = None, failing: str | None = None
) -> dict[str, Any]:
    with api_client(url) as client:
        sweep_id = store_documents_sweep(client, spec, failing)
        runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id}).json()["data"]
        return {
            "report": client.get(f"{API}/sweeps/{sweep_id}/report.md").text,
            "rows": client.get(f"{API}/sweeps/{sweep_id}/results.json").json(),
            "runs": {r["id"]: client.get(f"{API}/runs/{r['id']}").json() for r in runs},
            "pages": {r["id"]: client.get(f"/runs/{r['id']}").text for r in runs},
        }


def _balance(config: dict[str, Any]) -> str:
    balance = config["params"].get("balance")
    return "-" if balance is None else str(balance)


def test_the_section_is_recomputed_from_the_ranks(database_url: str) -> None:
    got = _read(database_url)
    tables = section_tables(got["report"])
    lengths = SPEC["grid"]["seq_len"]
    assert sorted(tables) == [(n, 2) for n in lengths], list(tables)
    single = {  # the W=1 partner of each length: dense, same mask and length
        run["config"]["seq_len"]: run
        for run in got["runs"].values()
        if run["config"]["world_size"] == 1
    }
    rows = {r["run_id"]: r for r in got["rows"]}
    for (length, world), table in tables.items():
        runs = [
            r
            for r in got["runs"].values()
            if (r["config"]["seq_len"], r["config"]["world_size"]) == (length, world)
        ]
        assert len(table) == len(runs) == len([c for c in CELLS if c[2] == 2])
        shown = {(line["scheme"], line["balance"]): line for line in table}
        one = max(r["median_s"] for r in single[length]["rank_results"])
        times = {}
        for run in runs:
            config, ranks = run["config"], run["rank_results"]
            want = recomputed(ranks, config)
            line = shown[(config["kernel"], _balance(config))]
            assert float(line["time"].split(" ms")[0]) == pytest.approx(
                want["median_s"] * 1e3, abs=0.006
            )
            for column, field in (("kept-pairs imbalance", "kept_pairs_imbalance"),
                                  ("measured imbalance", "compute_imbalance")):  # fmt: skip
                value = want[field]
                assert line[column] == ("-" if value is None else f"{value:.3f}"), (line, field)
                assert rows[run["id"]][field] == pytest.approx(value), field
            ideal = one / world / want["median_s"]  # (T_1 / W) / T_W
            assert line["% of ideal"] == f"{ideal:.1%}", line
            assert rows[run["id"]]["ideal_fraction"] == pytest.approx(ideal)
            assert rows[run["id"]]["ideal_run_id"] == single[length]["id"]
            waste = want["wasted_comm_share"]
            assert line["wasted comm"] == ("-" if waste is None else f"{waste:.1%}"), line
            assert rows[run["id"]]["wasted_comm_share"] == pytest.approx(waste)
            assert line["% of matmul"] == f"{want['matmul_fraction']:.1%}", line
            assert rows[run["id"]]["matmul_fraction"] == pytest.approx(want["matmul_fraction"])
            for field in ("kept_forward_tflops_per_s", "kept_backward_tflops_per_s"):
                assert rows[run["id"]][field] == pytest.approx(want[field]), field
            times[(config["kernel"], _balance(config))] = want["median_s"]
        fastest = [key for key, line in shown.items() if line["fastest"] == "**fastest**"]
        assert fastest == [min(times, key=times.__getitem__)], (fastest, times)
    # ring without a balance: its kept pairs split 30/70; ptrr evens them out
    assert {line["kept-pairs imbalance"] for line in tables[(1024, 2)]
            if line["scheme"] == "ring"} == {"1.400", "1.000"}  # fmt: skip


def test_the_run_page_says_the_same(tmp_path: Path) -> None:
    got = _read(f"sqlite:///{tmp_path / 'docs.db'}")
    for run_id, run in got["runs"].items():
        page, ranks = got["pages"][run_id], run["rank_results"]
        if run["config"]["world_size"] == 1:
            assert 'id="work-share"' not in page  # dense alone: no share, no partner
            continue
        want = recomputed(ranks, run["config"])
        assert f'<span id="compute-imbalance">{want["compute_imbalance"]:.3f}</span>' in page
        kept = want["kept_pairs_imbalance"]
        assert f'<span id="kept-imbalance">{"—" if kept is None else f"{kept:.3f}"}</span>' in page
        assert ' of ideal (<a href="/runs/' in page
        matmul = f'<span id="matmul-fraction">{want["matmul_fraction"]:.1%} of the node'
        assert matmul in page
        for rank in ranks:
            if rank["kept_pairs"] is not None:
                assert f'<td class="kept-pairs">{rank["kept_pairs"]:,}</td>' in page


def test_without_a_single_process_run_there_is_no_ideal(tmp_path: Path) -> None:
    spec = {**SPEC, "zip": {k: v[:-1] for k, v in SPEC["zip"].items()}}  # no dense W=1
    got = _read(f"sqlite:///{tmp_path / 'docs.db'}", spec)
    for table in section_tables(got["report"]).values():
        assert {line["% of ideal"] for line in table} == {"-"}
    assert {r["ideal_fraction"] for r in got["rows"]} == {None}
    assert all("% of ideal: none (no W=1 run of this cell)" in p for p in got["pages"].values())


def test_a_gather_is_named_in_the_scheme_and_still_paired_with_one_process(tmp_path: Path) -> None:
    gathers = [
        ("allgather_kv", {"balance": "none"}, 2),
        ("allgather_kv", {"balance": "none", "gather": "needed"}, 2),
        ("dense", {}, 1),
    ]
    zipped = {"kernel": [k for k, _, _ in gathers], "params": [p for _, p, _ in gathers],
              "world_size": [w for _, _, w in gathers]}  # fmt: skip
    got = _read(f"sqlite:///{tmp_path / 'docs.db'}", {**SPEC, "zip": zipped})
    single = {r["config"]["seq_len"]: r["id"] for r in got["runs"].values()
              if r["config"]["world_size"] == 1}  # fmt: skip
    for (length, _), table in section_tables(got["report"]).items():
        # gather: all is allgather_kv's declared default, so only `needed` is named
        assert [line["scheme"] for line in table] == [
            "allgather_kv",
            "allgather_kv · gather=needed",
        ]
        assert "-" not in {line["% of ideal"] for line in table}  # a gather moves K/V only
        runs = [r for r in got["rows"] if r["seq_len"] == length and r["world_size"] == 2]
        assert {r["ideal_run_id"] for r in runs} == {single[length]}


def test_a_sampled_mask_is_one_series_across_lengths(tmp_path: Path) -> None:
    """Its lengths written out differ per seq_len, but they follow from the one sampled spec:
    no label names them, and each scheme is one series across the lengths."""
    got = _read(f"sqlite:///{tmp_path / 'docs.db'}")
    assert not [r["label"] for r in got["rows"] if "lengths" in r["label"] or "[" in r["label"]]
    labels: dict[tuple[str, str, int], set[str]] = {}
    for r in got["rows"]:
        balance = got["runs"][r["run_id"]]["config"]["params"].get("balance")
        labels.setdefault((r["kernel"], str(balance), r["world_size"]), set()).add(r["label"])
    assert all(len(names) == 1 for names in labels.values()), labels
    assert len(labels) == len(CELLS)


def test_a_failed_single_process_run_gives_no_ideal(database_url: str) -> None:
    got = _read(database_url, failing="dense")
    failed = {
        r["config"]["seq_len"]: r["id"]
        for r in got["runs"].values()
        if r["config"]["world_size"] == 1 and r["status"] == "failed"
    }
    assert sorted(failed) == SPEC["grid"]["seq_len"]
    for table in section_tables(got["report"]).values():
        assert {line["% of ideal"] for line in table} == {"-"}
    for row in got["rows"]:
        assert row["ideal_fraction"] is None
        if row["world_size"] == 2:  # its partner named, with no time to divide
            one = failed[row["seq_len"]]
            assert row["ideal_run_id"] == one
            page = got["pages"][row["run_id"]]
            assert f"run {one}</a>, this cell at W=1, has no time)" in page


def test_a_sweep_without_documents_has_no_such_section(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 'plain.db'}") as client:
        sweep_id = _store(client, SPECS["ring_steps"])
        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        figures = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()["figures"]
    assert "Packed documents" not in report
    assert "chart-documents" not in figures


def test_the_imbalances_and_the_ideal_as_defined() -> None:
    def rank(i: int, kept: int | None, compute: float | None) -> RankResult:
        return RankResult(rank=i, seq_len=8, times_s=[1.0], median_s=1.0, p10_s=1.0, p90_s=1.0,
                          tokens_per_s=1.0, flops=1.0, flops_per_s=1.0, peak_memory_bytes=0,
                          backend="x", kept_pairs=kept, step_compute_s=compute,
                          forward_s=0.5 + i, backward_s=1.0 + i)  # fmt: skip

    ranks = [rank(0, 10, 1.0), rank(1, 30, 3.0)]
    assert work_share.kept_pairs_imbalance(ranks) == imbalance([10, 30]) == 1.5
    assert work_share.compute_imbalance(ranks) == 1.5
    forward, backward = work_share.kept_tflops_per_s(ranks, 32, 2, "train")
    assert forward == pytest.approx(4 * 32 * 40 * 2 / 1.5 / 1e12)
    assert backward == pytest.approx(2.5 * 4 * 32 * 40 * 2 / 2.0 / 1e12)
    # a rank that did not count its pairs, or no step clock: none, never a guess
    assert work_share.kept_pairs_imbalance([rank(0, None, None), rank(1, 3, None)]) is None
    assert work_share.compute_imbalance([rank(0, None, None), rank(1, 3, None)]) is None
    assert work_share.kept_tflops_per_s([rank(0, None, 1.0)], 32, 1, "train") == (None, None)
    assert work_share.ideal_fraction(0.5, 4, 1.0) == 0.5
    assert work_share.ideal_fraction(0.5, 4, None) is None
