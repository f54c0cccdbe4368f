"""report.md as a researcher reads it: rows in numeric order, one time unit for a run in every
table, and the level its intervals actually cover, stated.

A sweep is submitted through the API and its runs finished through the scheduler's write path
(as tests/service/test_result_goldens.py does) with planted times chosen to catch each defect:
labels whose numbers sort wrongly as text, and runs whose tables would pick different units.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from _api_helpers import api_client
from _results_helpers import timing
from test_report_tables import section

from service import leases
from service.results import write
from service.results.write import completion_from_outcome
from workers.config import RunConfig
from workers.results import EnvironmentInfo, RankResult, RunOutcome

API = "/api/v1"
CPU = {"device": "cpu", "num_heads": 2, "head_dim": 16, "dtype": "float32", "iterations": 3}
ENV = EnvironmentInfo(hosts=["node-a"], torch="2.13.0+cpu", python="3.11.7")


SPREAD = (0.96, 1.0, 1.08)


def finish_all(client: Any, spec: dict[str, Any], seconds: Any, spread: Any = SPREAD) -> int:
    """Submit `spec`; finish each run with every rank timed `spread` x seconds(config)."""
    created = client.post(f"{API}/sweeps", json=spec)
    assert created.status_code == 201, created.text
    sm = client.app.state.sessionmaker
    while (claim := leases.claim_next(sm, "reading", 60.0)) is not None:
        config = RunConfig.model_validate(claim.config)
        t = seconds(config)
        ranks = [
            RankResult(rank=r, seq_len=config.seq_len, backend="flash",
                       peak_memory_bytes=1 << 20, input_memory_bytes=1 << 19,
                       **timing([t * f for f in spread], config.seq_len, 1e9))
            for r in range(config.world_size)
        ]  # fmt: skip
        outcome = RunOutcome(status="succeeded", ranks=ranks, environment=ENV)
        assert write.finish(sm, claim, completion_from_outcome(outcome))
    return int(created.json()["id"])


def _time_cells(md: str, label: str) -> set[str]:
    """The units every time of the run `label` is written in, in every table of report.md."""
    units = set()
    for line in md.splitlines():
        if line.startswith(f"| {label} |"):
            units |= set(re.findall(r"\d (s|ms|us) ", line + " "))
    return units


def test_a_run_reads_in_one_time_unit_in_every_table(tmp_path: Path) -> None:
    """The results table holds a 1.45 s run, the baseline table only runs of 0.3-0.4 s: each
    table picking its own unit wrote the same 0.4 s run as "0.40 s" and "400.00 ms"."""
    spec = {
        "name": "units",
        "base": {**CPU, "parallel": "sequence"},
        "zip": {"kernel": ["dense", "ring", "ring"], "world_size": [1, 2, 2],
                "seq_len": [1024, 1024, 4096]},
        "analysis": {"baseline": {"kernel": "dense", "world_size": 1}},
    }  # fmt: skip
    times = {("dense", 1024): 0.3, ("ring", 1024): 0.4, ("ring", 4096): 1.4466}
    with api_client(f"sqlite:///{tmp_path / 'r.db'}") as client:
        sweep_id = finish_all(client, spec, lambda c: times[(c.kernel, c.seq_len)])
        md = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
    results = section(md, "## Results per run and sequence length")
    against = section(md, "## Against the baseline")
    assert "| 1.45 s |" in results and "| 0.40 s |" in results, results
    assert "0.40 s (0.38-0.43, n=3)" in against and " ms" not in against, against
    for label in ("dense · W=1", "ring · W=2"):
        assert _time_cells(md, label) == {"s"}, (label, md)


def test_rows_sort_by_their_numbers_and_the_interval_level_is_stated(tmp_path: Path) -> None:
    """Labels differing in a number read 4, 16, 128 in that order (as text: 128, 16, 4); the
    report says its intervals cover 75% (3 iterations) and what that means for a change."""
    spec = {
        "name": "order",
        "base": {**CPU, "kernel": "dense", "seq_len": 1024},
        "grid": {"batch_size": [128, 4, 16]},
    }
    with api_client(f"sqlite:///{tmp_path / 'r.db'}") as client:
        sweep_id = finish_all(client, spec, lambda c: 1e-3 * c.batch_size)
        md = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
    results = section(md, "## Results per run and sequence length").splitlines()[2:]
    assert [line.split(" | ")[0] for line in results] == [
        "| dense · batch_size=4",
        "| dense · batch_size=16",
        "| dense · batch_size=128",
    ], results
    assert "**Intervals**: the median intervals here cover 75% (3 iterations per run)." in md
    assert "too few iterations to tell a change from noise" in md


def test_a_pivot_of_axes_varying_together_puts_them_on_one_side(tmp_path: Path) -> None:
    """A weak-scaling sweep (seq_len zipped with world_size) pivoted seq len x world size was
    a diagonal, one cell per row; now each row names both and the times fill one column."""
    spec = {
        "name": "weak scaling",
        "base": {**CPU, "kernel": "ring"},
        "zip": {"seq_len": [1024, 2048, 4096], "world_size": [2, 4, 8]},
    }
    with api_client(f"sqlite:///{tmp_path / 'r.db'}") as client:
        sweep_id = finish_all(client, spec, lambda c: 1e-3 * c.seq_len / 1024)
        md = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        pivot_csv = client.get(f"{API}/sweeps/{sweep_id}/pivot.csv").text
    table = section(md, "## Time by seq len · world size and time")
    assert table.splitlines() == [
        "| Seq len · world size | time |",
        "|---|---|",
        "| 1,024 · W=2 | 1.00 ms |",
        "| 2,048 · W=4 | 2.00 ms |",
        "| 4,096 · W=8 | 4.00 ms |",
    ], table
    # the CSV is for machines: field names and raw numbers, both axes named on the rows' side
    assert [line.split(",")[:2] for line in pivot_csv.splitlines()] == [
        ["seq_len", "world_size"],
        ["1024", "2"],
        ["2048", "4"],
        ["4096", "8"],
    ], pivot_csv
    assert pivot_csv.splitlines()[0] == "seq_len,world_size,time", pivot_csv


def test_a_pivot_of_two_one_kernel_params_is_no_diagonal() -> None:
    """Rows of one kernel's param, columns of another's: each run sets one and leaves the
    other unset, so the table was a mostly empty diagonal; the params go on the rows' side."""
    from test_web import _row

    from service.results import baselines
    from service.spec import PivotSpec

    rows = [
        _row(1, 1.0, kernel="block_sparse", params={"sparsity_ratio": 0.1}),
        _row(2, 2.0, kernel="block_sparse", params={"sparsity_ratio": 0.05}),
        _row(3, 3.0, kernel="dilated", params={"dilation_rates": [1, 2]}),
        _row(4, 4.0, kernel="dilated", params={"dilation_rates": [1, 2, 4]}),
    ]
    baselines.set_labels(rows)
    spec = PivotSpec(rows="params.sparsity_ratio", columns=["params.dilation_rates"])
    table = baselines.pivot(rows, spec)
    cells = sum(len(values) for _, values in table.rows)
    filled = sum(v is not None for _, values in table.rows for v in values)
    assert filled == 4 and cells == 4, table.rows  # every cell of the table holds a run
    assert [name for name, _ in table.rows] == [
        "0.05 · block_sparse", "0.1 · block_sparse",
        "dilated · dilation_rates=[1,2]", "dilated · dilation_rates=[1,2,4]",
    ]  # fmt: skip
