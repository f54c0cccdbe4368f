"""End to end: a tiny CPU sweep submitted over the API runs on the local Ray; results come back."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _gang_helpers import run_queue

from workers.environment import cpu_model

API = "/api/v1"


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_tiny_cpu_sweep_runs_and_reports(tmp_path: Path, ray_session: Any) -> None:
    spec = {
        "name": "tiny cpu",
        "base": {
            "num_heads": 2,
            "head_dim": 16,
            "batch_size": 2,
            "device": "cpu",
            "warmup": 1,
            "iterations": 3,
            "timeout_s": 120,
        },
        "grid": {"seq_len": [128, 256], "world_size": [1, 2]},
        # dense splits the batch over the ranks; ring splits the sequence
        "zip": {"kernel": ["dense", "ring"], "parallel": ["data", "sequence"]},
    }
    with api_client(f"sqlite:///{tmp_path / 'e2e.db'}") as client:
        created = client.post(f"{API}/sweeps", json=spec)
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        assert created.json()["total"] == 8

        assert run_queue(client.app.state.sessionmaker) == 8

        sweep = client.get(f"{API}/sweeps/{sweep_id}").json()
        assert sweep["done"] and sweep["counts"]["succeeded"] == 8, sweep["counts"]

        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        assert len(rows) == 8
        for row in rows:  # the gate runs by default: its error and lengths in every outcome
            assert row["environment_id"] is not None
            assert 0 < row["max_abs_error"] <= 1e-4, row
            n, full = row["seq_len"], row["check_seq_len"]
            assert full == 128  # dense and ring have no structure: 128 tokens, every row
            if n == 128:
                assert row["outcome"] == f"ok (max abs err {row['max_abs_error']:.1e} at 128)"
            else:  # and sampled rows at the run's own length
                assert 0 < row["sampled_check_error"] <= 1e-4 and row["sampled_check_seq_len"] == n
                assert row["outcome"] == (
                    f"ok (max abs err {row['max_abs_error']:.1e} at 128; "
                    f"{row['sampled_check_error']:.1e} at {n} on {row['sampled_check_rows']} rows)"
                )
            assert row["median_s"] > 0 and row["tflops_per_s"] > 0
            expected = row["batch_size"] * row["seq_len"] / row["median_s"]
            assert row["tokens_per_s"] == pytest.approx(expected)
            assert row["peak_memory_bytes"] is not None and row["peak_memory_bytes"] >= 0
        assert {(r["kernel"], r["world_size"]) for r in rows} == {
            (k, w) for k in ("dense", "ring") for w in (1, 2)
        }

        table = list(
            csv.DictReader(io.StringIO(client.get(f"{API}/sweeps/{sweep_id}/results.csv").text))
        )
        assert len(table) == 8 and all(float(r["median_s"]) > 0 for r in table)

        two_ranks = next(r for r in rows if r["kernel"] == "ring" and r["world_size"] == 2)
        detail = client.get(f"{API}/runs/{two_ranks['run_id']}").json()
        assert [rr["rank"] for rr in detail["rank_results"]] == [0, 1]
        assert detail["environment"]["torch"]
        assert detail["environment"]["cpu_threads"] == 1  # a Ray rank runs on its one CPU

        md = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        assert "## Results per run and sequence length" in md and "## Environment" in md
        env_lines = md[md.index("## Environment") :].splitlines()[2:]
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in env_lines[:3]]
        header, rows = cells[0], [r for r in cells[2:] if len(r) == len(cells[0])]
        assert rows and all(r[header.index("CPU threads")] == "1" for r in rows), cells
        # the CPU a CPU time ran on, as the host says (its /proc/cpuinfo model, os.cpu_count())
        model, cores = cpu_model(), os.cpu_count()
        assert (detail["environment"]["cpu_model"], detail["environment"]["cpu_cores"]) == (
            model,
            cores,
        )
        assert all(r[header.index("CPU")] == f"{model} ({cores} logical CPUs)" for r in rows)
        # the node's matmul rate, probed once per node in the run's dtype: 2 n^3 / seconds
        env = detail["environment"]
        assert env["matmul_dtype"] == "float32" and env["matmul_s"] > 0
        assert env["matmul_flops_per_s"] == pytest.approx(
            2 * env["matmul_size"] ** 3 / env["matmul_s"]
        )
        shown = f"{env['matmul_flops_per_s'] / 1e9:.3g} GFLOP/s (float32, n={env['matmul_size']:,})"
        assert any(r[header.index("matmul")] == shown for r in rows), cells
        page = client.get(f"/runs/{two_ranks['run_id']}").text
        assert f"{model} · {cores} logical CPUs" in page
        assert "| ring · " in md and "| dense · " in md
        assert "| W=1 | " in md or "| dense W=1 | " in md  # W=2 rows name their baseline
        assert md.count("| ok (max abs err ") == 8
