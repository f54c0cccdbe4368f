"""The plan a run ran is recorded where its stored config leaves it to the device: a dilated run
with `plan: auto` and device auto keeps auto in its stored config (its cell unchanged), and its
rank reports the plan it ran, which the API record, results.json, the CSV, report.md and the
run page all show."""

from __future__ import annotations

import csv
import io
from typing import Any

from _api_helpers import api_client, run_in_process

API = "/api/v1"
SPEC = {
    "name": "dilated on the device's plan",
    "base": {"kernel": "dilated", "device": "auto", "dtype": "float32", "num_heads": 2,
             "head_dim": 16, "seq_len": 256, "iterations": 1, "warmup": 0,
             "params": {"segment_lengths": [64, 128], "dilation_rates": [1, 2]}},
}  # fmt: skip


def test_a_dilated_run_on_device_auto_records_the_plan_its_rank_ran(tmp_path: Any) -> None:
    with api_client(f"sqlite:///{tmp_path / 'plan.db'}") as client:
        sweep_id = run_in_process(client, SPEC)
        (row,) = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        run_id = row["run_id"]
        record = client.get(f"{API}/runs/{run_id}").json()
        text = client.get(f"{API}/sweeps/{sweep_id}/results.csv").text
        table = list(csv.DictReader(io.StringIO(text)))
        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        page = client.get(f"/runs/{run_id}").text
    assert record["config"]["device"] == "auto"
    assert record["config"]["params"]["plan"] == "auto"  # the stored cell is as submitted
    (rank,) = record["rank_results"]
    assert rank["plan"] == "cpu" and rank["backend"].endswith("/plan-cpu")  # no GPU here
    ran = ",".join(sorted({r["plan"] for r in record["rank_results"]}))
    assert row["plan"] == ran == "cpu"
    assert row["device"] == "CPU"  # the device auto became, from the run's environment
    assert [(int(r["run_id"]), r["plan"]) for r in table] == [(run_id, "cpu")]
    (line,) = [x for x in report.splitlines() if x.startswith("**Plan**")]
    assert line.endswith(f"ran as {row['plan']} on run {run_id}")
    assert f">plan {row['plan']}</span>" in page and 'id="plan"' in page
