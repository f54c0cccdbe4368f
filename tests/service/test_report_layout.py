"""What a researcher reads in report.md (issue 40): the default pivot of
examples/cpu-dp-vs-ring-2gpu.yaml reads like a paper's table (golden text): the lengths down,
every kernel x world size x parallel mode across (W=1 without a parallel mode), the mode fixed
per section, every cell filled, and one time unit per table chosen from its values."""

from __future__ import annotations

from typing import Any

from test_report_tables import MiB, client_for, put, report, section, submit

from service.db.models import Run
from service.units import time_unit


def _store(client: Any, scale: float) -> int:
    """The dp-vs-ring sweep with W=1 t, data-parallel 0.6 t, ring 0.7 t, where forward t =
    `scale` x (seq_len / 1K)^2 seconds and train 3.5x that."""
    runs = submit(client, "cpu-dp-vs-ring-2gpu.yaml")
    for r in runs:
        c = r["config"]
        t = (c["seq_len"] / 1024) ** 2 * scale * (3.5 if c["mode"] == "train" else 1.0)
        share = {1: 1.0, 2: 0.6 if c["parallel"] == "data" else 0.7}[c["world_size"]]
        w = c["world_size"]
        put(client, r["id"], medians=[share * t] * w, peaks=[8 * MiB] * w)
    return int(runs[0]["sweep_id"])


HEADER = (
    "| Seq len | dense · W=1 | dense · W=2 · data-parallel | ring · W=2 · sequence-parallel |\n"
    "|---|---|---|---|\n"
)


def test_default_pivot_lines_up_cells_and_picks_one_time_unit(database_url: str) -> None:
    with client_for(database_url) as client:
        in_ms = report(client, _store(client, 1e-3))
        in_s = report(client, _store(client, 0.1))
    assert section(in_ms, "## Time by seq len and kernel x world size x parallel") == (
        "### mode forward\n" + HEADER + "| 1,024 | 1.00 ms | 0.60 ms | 0.70 ms |\n"
        "| 2,048 | 4.00 ms | 2.40 ms | 2.80 ms |\n"
        "| 4,096 | 16.00 ms | 9.60 ms | 11.20 ms |\n"
        "| 8,192 | 64.00 ms | 38.40 ms | 44.80 ms |\n"
        "### mode train\n" + HEADER + "| 1,024 | 3.50 ms | 2.10 ms | 2.45 ms |\n"
        "| 2,048 | 14.00 ms | 8.40 ms | 9.80 ms |\n"
        "| 4,096 | 56.00 ms | 33.60 ms | 39.20 ms |\n"
        "| 8,192 | 224.00 ms | 134.40 ms | 156.80 ms |"
    )
    # the same sweep 100x slower: seconds throughout (3 decimals: the fastest is 0.060 s),
    # never "4155.18 ms" beside "0.70 ms"
    assert section(in_s, "### mode train") == (
        HEADER + "| 1,024 | 0.350 s | 0.210 s | 0.245 s |\n"
        "| 2,048 | 1.400 s | 0.840 s | 0.980 s |\n"
        "| 4,096 | 5.600 s | 3.360 s | 3.920 s |\n"
        "| 8,192 | 22.400 s | 13.440 s | 15.680 s |"
    )
    results = section(in_s, "## Results per run and sequence length")
    assert " ms |" not in results and "| 22.400 s | 21.280 s - 23.520 s |" in results, results
    assert "W=1 · sequence" not in in_ms and "sequence-parallel · W=1" not in in_ms


def test_time_unit_follows_the_median_value() -> None:
    assert time_unit([0.0007, 0.002, 4.155]).name == "ms"
    assert time_unit([0.9, 2.66, 4.155])(4.155) == "4.16 s"
    assert time_unit([2e-5, 3e-5])(2e-5) == "20.00 us"
    assert time_unit([0.0007, 1.5, 2.0, 4.0])(0.0007) == "0.0007 s"
    assert time_unit([])(0.001) == "1.00 ms"


def test_runs_timed_beside_others_are_named_in_report_and_run_page(database_url: str) -> None:
    """A run whose gang shared its nodes (run.cotenants, recorded by the scheduler) is named in
    report.md's note and on its run page; a run that ran alone says so on its page, and a
    sweep where every run ran alone has no note."""
    with client_for(database_url) as client:
        sweep_id = _store(client, 1e-3)
        alone = report(client, sweep_id)
        assert "shared their nodes" not in alone
        runs = client.get("/api/v1/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()
        ids = [r["id"] for r in runs["data"]]
        with client.app.state.sessionmaker() as session:
            for run_id, cotenants in ((ids[0], [ids[1], ids[2]]), (ids[1], [ids[0]]), (ids[2], [])):
                session.get(Run, run_id).cotenants = cotenants
            session.commit()
        text = report(client, sweep_id)
        assert (
            f"**2 of {len(ids)} runs were timed while other runs shared their nodes** "
            f"(run {ids[0]} beside {ids[1]}, {ids[2]}; run {ids[1]} beside {ids[0]})"
        ) in text
        page = client.get(f"/runs/{ids[0]}").text
        assert f'<a href="/runs/{ids[1]}">run {ids[1]}</a>' in page and "timed beside" in page
        assert "ran alone on its nodes" in client.get(f"/runs/{ids[2]}").text
