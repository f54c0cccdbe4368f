"""The CPU study of packed documents (examples/cpu-documents.yaml, cut down) through the service
on a real local Ray gang of 2 ranks: each cell's sampled mask stored as its lengths, every cell
gated against the mask's fp64 reference, each rank's kept pairs stored (their imbalance read
back) and the K/V bytes it received and wasted (recounted from the dense mask), a balanced run
compared with the same kernel without a balance, and report.md's "Packed documents: balance and
schemes" section recomputed from the ranks' raw fields (no W=1 run in the study: % of ideal
says none; tests/service/test_work_share.py reads it against one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _api_helpers import api_client
from _documents_helpers import recomputed, section_tables
from _gang_helpers import run_queue

import attention
from attention import layouts
from attention.mask import expand, parse
from service.cli.specs import load_specs

API = "/api/v1"
CELLS = [("ring", "none"), ("ring", "per_document"), ("allgather_kv", "ptrr")]


def _cut_down_study() -> dict[str, Any]:
    """cpu-documents.yaml at its shortest length, three cells, heads and head_dim cut, one
    iteration."""
    (study,) = load_specs("cpu-documents.yaml")
    study["base"] |= {"num_heads": 2, "head_dim": 8, "iterations": 1, "timeout_s": 300}
    study["grid"] = {"seq_len": [min(study["grid"]["seq_len"])]}
    zipped = zip(study["zip"]["kernel"], study["zip"]["params"], strict=True)
    shipped = [
        (kernel, params.get("balance")) for kernel, params in zipped if "gather" not in params
    ]
    assert all(cell in shipped for cell in CELLS)
    assert ("dense", None) in shipped  # the single-process run of % of ideal (not run here)
    study["zip"] = {
        "kernel": [k for k, _ in CELLS],
        "params.balance": [b for _, b in CELLS],
    }
    return study


def _kv_bytes(
    kernel: str, params: dict[str, Any], mask: dict[str, Any], base: dict[str, Any]
) -> list[tuple[int, int]]:
    """Each rank's (comm_bytes, wasted_comm_bytes) recounted from the dense mask: the other
    rank's whole shard received forward and backward (train), the rows none of its queries
    keeps wasted; a row is one token's K and V over every head, float32."""
    seq_len = sum(mask["lengths"])
    module = attention.build(kernel, mask=mask, balance=params["balance"])
    held = [module.local_positions(seq_len, r, 2, causal=True) for r in range(2)]
    keep = parse(mask, seq_len).dense(seq_len)
    row = 2 * base["num_heads"] * base["head_dim"] * 4
    out = []
    for rank in range(2):
        other = held[1 - rank]
        kept = int(keep[held[rank]].any(0)[other].sum())
        out.append((2 * other.numel() * row, 2 * (other.numel() - kept) * row))
    return out


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_the_documents_study_runs_through_the_service(tmp_path: Path, ray_session: Any) -> None:
    study = _cut_down_study()
    seq_len = study["grid"]["seq_len"][0]
    with api_client(f"sqlite:///{tmp_path / 'docs.db'}") as client:
        created = client.post(f"{API}/sweeps", json=study)
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        run_queue(client.app.state.sessionmaker)
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        runs = client.get(f"{API}/runs").json()["data"]
        ranks = {
            run["id"]: client.get(f"{API}/runs/{run['id']}").json()["rank_results"] for run in runs
        }
    assert [r["status"] for r in rows] == ["succeeded"] * 3, [r["error"] for r in rows]
    want = expand(study["base"]["params"]["mask"], seq_len)
    pairs = study["base"]["num_heads"] * parse(want, seq_len).pairs(seq_len)
    for run in runs:
        assert run["config"]["params"]["mask"] == want  # the lengths that ran
        kept = torch.tensor([r["kept_pairs"] for r in ranks[run["id"]]])
        assert int(kept.sum()) == pairs  # each rank's share of the mask's pairs, stored
        assert layouts.imbalance(kept) >= 1.0  # the imbalance, from stored data
        comm = [(r["comm_bytes"], r["wasted_comm_bytes"]) for r in ranks[run["id"]]]
        assert comm == _kv_bytes(run["kernel"], run["config"]["params"], want, study["base"])
    by_cell = {}
    for row in rows:
        assert row["max_abs_error"] is not None and 0 < row["max_abs_error"] < 1e-4, row
        balance = next(r for r in runs if r["id"] == row["run_id"])["config"]["params"]["balance"]
        by_cell[(row["kernel"], balance)] = row
    assert sorted(by_cell) == sorted(CELLS)
    plain, balanced = by_cell[("ring", "none")], by_cell[("ring", "per_document")]
    assert balanced["baseline_run_id"] == plain["run_id"]
    assert balanced["speedup"] == pytest.approx(balanced["tokens_per_s"] / plain["tokens_per_s"])
    _section_recomputed(report, seq_len, runs, ranks, rows)


def _section_recomputed(
    report: str,
    seq_len: int,
    runs: list[dict[str, Any]],
    ranks: dict[int, list[dict[str, Any]]],
    rows: list[dict[str, Any]],
) -> None:
    """The section's one table (the length, W=2): each cell's imbalances as recomputed from its
    ranks' raw fields, no % of ideal without a W=1 run, the fastest the cell with the smallest
    slowest-rank median; results.json agrees."""
    ((key, table),) = section_tables(report).items()
    assert key == (seq_len, 2)
    shown = {(line["scheme"], line["balance"]): line for line in table}
    assert sorted(shown) == sorted(CELLS)
    by_id = {r["run_id"]: r for r in rows}
    times = {}
    for run in runs:
        cell = (run["config"]["kernel"], run["config"]["params"]["balance"])
        want = recomputed(ranks[run["id"]], run["config"])
        line = shown[cell]
        assert line["kept-pairs imbalance"] == f"{want['kept_pairs_imbalance']:.3f}", line
        assert line["measured imbalance"] == f"{want['compute_imbalance']:.3f}", line
        assert line["% of ideal"] == "-", line
        for field in ("kept_pairs_imbalance", "compute_imbalance", "kept_forward_tflops_per_s"):
            assert by_id[run["id"]][field] == pytest.approx(want[field]), field
        assert by_id[run["id"]]["ideal_fraction"] is None
        times[cell] = want["median_s"]
    fastest = [cell for cell, line in shown.items() if line["fastest"] == "**fastest**"]
    assert fastest == [min(times, key=times.__getitem__)], (fastest, times)
