"""What a user reads about noise, recomputed from the raw stored times: a stored sweep of
examples/cpu-dp-vs-ring-2gpu.yaml (synthetic times drawn around known medians) shows no
speedup above the world size without a flag, marks the ratios within noise, flags a peak below
the inputs; two sweeps of one spec compare without regressions, a planted 2x slower cell is
one; the compare page says the specs are identical."""

from __future__ import annotations

import math
import random
import re
import statistics
from typing import Any

import pytest
from _api_helpers import mark_succeeded
from sqlalchemy.orm import Session
from test_report_tables import API, MiB, client_for, report, section, submit

from service.cli.specs import load_specs
from service.db.models import RankResultRow, Sweep
from service.results.queries import rows_page

ITERATIONS = 12


def median_ci(times: list[float]) -> tuple[float, float]:
    """The 95% order-statistic interval of the median, computed here from the binomial."""
    n, ordered = len(times), sorted(times)
    lo = 1
    while 1 - 2 * sum(math.comb(n, i) for i in range(lo + 1)) / 2**n >= 0.95:
        lo += 1
    return ordered[lo - 1], ordered[n - lo]


def put_times(
    client: Any, run_id: int, times: list[list[float]], peaks: list[int], inputs: list[int]
) -> None:
    """Store a finished run: each rank's raw times, its peak and the inputs it held."""
    sm = client.app.state.sessionmaker
    with sm() as session:
        session: Session
        run = mark_succeeded(session, run_id, "noise")
        for rank, (ts, peak, held) in enumerate(zip(times, peaks, inputs, strict=True)):
            ordered = sorted(ts)
            median = statistics.median(ts)
            session.add(
                RankResultRow(
                    run_id=run_id, rank=rank, seq_len=run.seq_len, times_s=ts, median_s=median,
                    p10_s=ordered[1], p90_s=ordered[-2], tokens_per_s=run.seq_len / median,
                    flops=1e9, flops_per_s=1e9 / median, peak_memory_bytes=peak,
                    input_memory_bytes=held, backend="sdpa-flash-cpu",
                )
            )  # fmt: skip
        session.commit()


def _draw(rng: random.Random, median: float, spread: float) -> list[float]:
    return [median * (1 + rng.uniform(-spread, spread)) for _ in range(ITERATIONS)]


SUPERLINEAR = (1024, "forward")
"""The cell whose data-parallel run is planted 2.6x faster than W=1: above W=2 beyond noise."""
LOW_PEAK = (2048, "train")
"""The cell whose ring run's rank 1 reports a peak below its inputs."""


def store_dp_sweep(
    client: Any,
    seed: int,
    slower: tuple[int, str] | None = None,
    analysis: dict[str, Any] | None = None,
) -> int:
    """cpu-dp-vs-ring-2gpu.yaml with times drawn +-4% around t (W=1), t / 1.8 (data parallel;
    t / 2.6 at SUPERLINEAR) and t (ring: no faster); the ring at `slower` takes 2 t. With
    `analysis`, the spec carries that analysis block."""
    rng = random.Random(seed)
    if analysis is None:
        runs = submit(client, "cpu-dp-vs-ring-2gpu.yaml")
    else:
        doc = {**load_specs("cpu-dp-vs-ring-2gpu.yaml")[0], "analysis": analysis}
        created = client.post(f"{API}/sweeps", json=doc)
        assert created.status_code == 201, created.text
        listed = client.get(
            f"{API}/runs", params={"sweep_id": created.json()["id"], "sort": "id", "limit": 500}
        )
        runs = listed.json()["data"]
    for r in runs:
        c = r["config"]
        cell = (c["seq_len"], c["mode"])
        t = (c["seq_len"] / 1024) ** 2 * 1e-3 * (3.5 if c["mode"] == "train" else 1.0)
        w = c["world_size"]
        if w == 2 and c["parallel"] == "data":
            t /= 2.6 if cell == SUPERLINEAR else 1.8
        elif w == 2 and cell == slower:
            t *= 2
        inputs = [4 * MiB] * w
        peaks = [9 * MiB] * w
        if w == 2 and c["parallel"] == "sequence" and cell == LOW_PEAK:
            peaks[1] = 3 * MiB
        put_times(client, r["id"], [_draw(rng, t, 0.04) for _ in range(w)], peaks, inputs)
    return int(runs[0]["sweep_id"])


def _slow_ci(row: dict[str, Any], raw: dict[int, list[list[float]]]) -> tuple[float, float]:
    """The slowest rank's median interval of a run, from its raw times."""
    slow = max(raw[row["run_id"]], key=statistics.median)
    return median_ci(slow)


def _raw_times(client: Any, rows: list[dict[str, Any]]) -> dict[int, list[list[float]]]:
    out = {}
    for row in rows:
        detail = client.get(f"{API}/runs/{row['run_id']}").json()
        out[row["run_id"]] = [rr["times_s"] for rr in detail["rank_results"]]
    return out


def test_report_flags_speedups_above_w_and_marks_those_within_noise(database_url: str) -> None:
    with client_for(database_url) as client:
        sweep_id = store_dp_sweep(client, seed=1)
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        raw = _raw_times(client, rows)
        md = report(client, sweep_id)
        (superlinear,) = [r for r in rows if r["speedup_lo"] and r["speedup_lo"] > 2]
        page = client.get(f"/runs/{superlinear['run_id']}").text
        dash = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()["rows"]
    # the run page and the sweep page's rows carry the same flags (the page marks them)
    assert 'data-code="speedup_above_world_size"' in page
    assert 'data-code="efficiency_above_100"' in page
    assert "above the physical limit" in page
    (dash_row,) = [r for r in dash if r["run_id"] == superlinear["run_id"]]
    assert dash_row["flags"] == superlinear["flags"]
    assert dash_row["speedup_lo"] == superlinear["speedup_lo"]
    by_id = {r["run_id"]: r for r in rows}
    against = section(md, "## Against the baseline")
    flagged = 0
    for row in rows:
        if row["baseline_run_id"] is None:
            continue
        base = by_id[row["baseline_run_id"]]
        a_lo, a_hi = _slow_ci(base, raw)  # the baseline's time: speedup = t_base / t
        b_lo, b_hi = _slow_ci(row, raw)
        lo, hi = a_lo / b_hi, a_hi / b_lo
        assert (row["speedup_lo"], row["speedup_hi"]) == (pytest.approx(lo), pytest.approx(hi))
        line = next(
            x for x in against.splitlines() if f"| {row['seq_len']:,} | {row['baseline']} | " in x
            and x.startswith(f"| {row['label']} |")
        )  # fmt: skip
        codes = {f["code"] for f in row["flags"]}
        speedup = row["speedup"]
        assert f"{speedup:.2f}x ({lo:.2f}-{hi:.2f}" in line, line
        if lo > 2:  # above W=2 beyond the noise: flagged, marked, explained
            flagged += 1
            assert {"speedup_above_world_size", "efficiency_above_100"} <= codes
            assert "⚠[^speedup_above_world_size]" in line
            assert "⚠[^efficiency_above_100]" in line
        else:
            assert "speedup_above_world_size" not in codes and "⚠[^speedup" not in line
        if lo <= 1 <= hi:
            assert "within noise" in line and "speedup" in row["within_noise"]
        else:
            assert "within noise" not in line
    # only the planted cell is above W=2, and the ring (no faster than one rank) is within noise
    assert flagged == 1
    # no speedup cell above W=2 without a flag beside it or an interval reaching down to W
    cells = [x.strip("|").split(" | ")[5] for x in against.splitlines()[2:]]
    assert len(cells) == 16
    for cell in cells:
        found = re.match(r" ?(\d+\.\d\d)x \((\d+\.\d\d)-", cell)
        assert found is not None, cell
        value, low = float(found.group(1)), float(found.group(2))
        assert value <= 2 or low <= 2 or "⚠[^speedup_above_world_size]" in cell, cell
    assert "[^speedup_above_world_size]: Speedup above the world-size ratio" in md
    ring = [r for r in rows if r["parallel"] == "sequence" and r["world_size"] == 2]
    assert all("speedup" in r["within_noise"] for r in ring)


def test_a_peak_below_the_inputs_is_flagged(database_url: str) -> None:
    with client_for(database_url) as client:
        sweep_id = store_dp_sweep(client, seed=2)
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        csv_text = client.get(f"{API}/sweeps/{sweep_id}/results.csv").text
        md = report(client, sweep_id)
    low = [r for r in rows if any(f["code"] == "peak_below_inputs" for f in r["flags"])]
    assert [(r["seq_len"], r["mode"], r["parallel"], r["world_size"]) for r in low] == [
        (*LOW_PEAK, "sequence", 2)
    ]
    (flag,) = low[0]["flags"]
    assert flag["field"] == "peak_memory_bytes"
    assert f"rank 1: peak {3 * MiB:,} B < inputs {4 * MiB:,} B" in flag["text"]
    assert "peak_memory_bytes:peak_below_inputs" in csv_text
    results = section(md, "## Results per run and sequence length")
    line = next(x for x in results.splitlines() if x.startswith(f"| {low[0]['label']} | 2,048 |"))
    assert "| 9.00 MiB | 3.00 MiB ⚠[^peak_below_inputs] |" in line
    assert "[^peak_below_inputs]: Peak memory below the inputs" in md


def _verdict(html: str) -> str:
    found = re.search(r'<p id="verdict">(.*?)</p>', html, re.S)
    assert found is not None, html
    return " ".join(found.group(1).split())


def test_two_identical_sweeps_compare_without_regression_a_2x_slower_one_with(
    database_url: str,
) -> None:
    with client_for(database_url) as client:
        a = store_dp_sweep(client, seed=3)
        b = store_dp_sweep(client, seed=4)  # the same spec, other noise
        c = store_dp_sweep(client, seed=5, slower=(4096, "forward"))
        same = client.get("/compare", params={"a": a, "b": b}).text
        planted = client.get("/compare", params={"a": a, "b": c}).text
        api_same = client.get(f"{API}/sweeps/{a}/compare/{b}").json()
        api_planted = client.get(f"{API}/sweeps/{a}/compare/{c}").json()
        pivot = {"pivot": {"rows": "seq_len", "columns": ["parallel"], "value": "speedup"}}
        other = store_dp_sweep(client, seed=3, analysis=pivot)  # another spec, the same times
        api_other = client.get(f"{API}/sweeps/{a}/compare/{other}").json()
        missing = client.get(f"{API}/sweeps/{a}/compare/999999")
    # the API says what the page says
    assert api_same["same_spec"] and api_same["regressions"] == 0
    assert len(api_same["pairs"]) == 24 and api_same["within_noise"] >= 1
    for p in api_same["pairs"]:  # every pair's interval holds 1 or the time_change says why
        assert p["tps_lo"] <= p["tps_ratio"] <= p["tps_hi"]
        assert p["within_noise"] == (p["tps_lo"] <= 1 <= p["tps_hi"])
    assert api_planted["regressions"] == 1 and api_planted["same_spec"]
    (slow,) = [p for p in api_planted["pairs"] if p["regression"]]
    assert slow["reasons"] == ["slower"] and slow["tps_hi"] < 1
    assert not api_other["same_spec"] and api_other["regressions"] == 0
    assert missing.status_code == 404
    assert "A and B ran identical specs" in same
    assert _verdict(same).startswith("24 matching cells (0 only in A, 0 only in B); 0 regressions")
    assert _verdict(planted).startswith(
        "24 matching cells (0 only in A, 0 only in B); 1 regressions"
    )
    rows = re.findall(r'<tr class="regression">(.*?)</tr>', planted, re.S)
    assert len(rows) == 1 and "ring" in rows[0] and "4,096" in rows[0] and "slower" in rows[0]


def test_the_terminal_table_marks_speedups_as_the_report_does() -> None:
    """`ringlab results`: ⚠ beside a flagged speedup, ~ beside one within noise."""
    from service.cli.results import _speedup_note

    flag = {"code": "speedup_above_world_size", "field": "speedup", "text": "above W"}
    assert _speedup_note({"flags": [flag], "within_noise": []}) == " ⚠"
    assert _speedup_note({"flags": [], "within_noise": ["speedup"]}) == " ~"
    peak = {**flag, "field": "peak_memory_bytes"}
    assert _speedup_note({"flags": [peak], "within_noise": []}) == ""


def test_a_pivot_of_speedups_marks_the_flagged_one(database_url: str) -> None:
    pivot = {"rows": "seq_len", "columns": ["parallel"], "value": "speedup"}
    with client_for(database_url) as client:
        sweep_id = store_dp_sweep(client, seed=6, analysis={"pivot": pivot})
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        md = report(client, sweep_id)
    table = section(md, "## Speedup by seq len and kernel x parallel")
    (flagged,) = [r for r in rows if r["flags"] and r["speedup_lo"] and r["speedup_lo"] > 2]
    forward = table.split("### mode train")[0]
    line = next(x for x in forward.splitlines() if x.startswith("| 1,024 |"))
    assert f"{flagged['speedup']:.2f}x ⚠[^speedup_above_world_size]" in line, table
    assert sum("⚠" in x for x in table.splitlines()) == 1


def test_limit_flags_without_an_interval_and_for_a_maximum_length() -> None:
    """A speedup above W from runs of one iteration (no interval to tell the noise) is flagged
    all the same; a max-length gain above W at 2 ranks flags the efficiency."""
    from test_web import _row

    from service.results import baselines

    one = _row(1, median=1.0)
    two = _row(2, median=0.4, world_size=2)  # 2.5x at W=2
    for r in (one, two):
        r.median_lo_s = r.median_hi_s = r.median_ci_level = None
        r.iterations = 1
    baselines.apply([one, two], None)
    assert two.speedup == 2.5 and two.speedup_lo is None
    codes = {(f.code, f.field) for f in two.flags}
    assert codes == {
        ("speedup_above_world_size", "speedup"),
        ("efficiency_above_100", "efficiency"),
    }
    assert "no interval to tell the noise" in two.flag("speedup_above_world_size", "speedup").text
    base = _row(11, median=1.0, search={"start": 1024})
    wide = _row(12, median=1.0, world_size=2, search={"start": 1024})
    for r, found in ((base, 8192), (wide, 20480)):
        r.searched, r.max_seq_len = True, found
    baselines.apply([base, wide], None)
    assert wide.max_len_gain == 2.5 and wide.efficiency == 1.25
    (flag,) = wide.flags
    assert (flag.code, flag.field) == ("efficiency_above_100", "efficiency")
    assert "max-length gain of 2.50x" in flag.text


def test_the_scaling_chart_draws_the_intervals_and_crosses_the_flagged_point(
    database_url: str,
) -> None:
    from service.results import charts

    with client_for(database_url) as client:
        sweep_id = store_dp_sweep(client, seed=7)
        payload = client.get(f"/sweeps/{sweep_id}/dashboard.json").json()
        with client.app.state.sessionmaker() as session:
            read = rows_page(session, session.get(Sweep, sweep_id))  # the rows the page charts
    rows = {r["run_id"]: r for r in payload["rows"]}
    # two world sizes: the page shows a table (the flagged cell marked), the chart needs 3
    assert "chart-scaling" not in payload["figures"]
    flagged_cells = [c for _, cells in payload["scaling"]["rows"] for c in cells if c["flag"]]
    assert len(flagged_cells) == 1 and "above 100%" in flagged_cells[0]["flag"]
    fig = charts.scaling_figure(read)
    (cross,) = [t for t in fig["data"] if t.get("name") == "above 100% (flagged)"]
    (flagged,) = [r for r in rows.values() if r["efficiency_lo"] and r["efficiency_lo"] > 1]
    assert cross["x"] == [2] and cross["y"] == [flagged["efficiency"]]
    assert "above 100%" in cross["text"][0]
    series = [t for t in fig["data"] if t.get("error_y")]
    assert len(series) == 16  # one per W=2 cell; each line's W=2 point carries its interval
    for t in series:
        (w2,) = [i for i, w in enumerate(t["x"]) if w == 2]
        assert t["error_y"]["array"][w2] > 0 and t["error_y"]["arrayminus"][w2] > 0


def test_a_cell_rerun_under_auto_matches_its_predecessor_on_the_compare_page() -> None:
    from service.results.rows import config_key

    old = {"kernel": "dense", "seq_len": 1024, "warmup": 2, "iterations": 5}
    assert config_key(old) == config_key({**old, "iterations": "auto", "time_cap_s": None})
    assert config_key(old) == config_key({**old, "iterations": "auto", "time_cap_s": 5.0})
    assert config_key(old) != config_key({**old, "warmup": 1})


def test_no_limit_flag_against_a_baseline_that_changes_more_than_the_ranks() -> None:
    """W / baseline W bounds a speedup only against the same work on fewer ranks: a sparse
    kernel at W=2 against dense at W=1 (a custom baseline) may well be 3x faster."""
    from test_web import _row

    from service.results import baselines

    dense = _row(1, median=1.0)
    sparse = _row(2, median=1 / 3, world_size=2, kernel="block_sparse",
                  params={"block_size": 64, "sparsity_ratio": 0.1})  # fmt: skip
    same = _row(3, median=1 / 3, world_size=2)
    for r in (sparse, same):
        r.speedup, r.speedup_lo, r.speedup_hi, r.iterations = 3.0, 2.8, 3.2, 12
    assert not baselines.same_work(sparse, dense) and baselines.limit_flags(sparse, dense) == []
    assert baselines.same_work(same, dense)
    assert [f.code for f in baselines.limit_flags(same, dense)] == [
        "speedup_above_world_size",
        "efficiency_above_100",
    ]


def test_ringlab_results_explains_its_tilde_under_the_table(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ringlab results` at 80 columns of a sweep with speedups within noise: the `~` beside
    them is explained under the table, once."""
    from _web_helpers import live_server, make_web_app
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from service import cli
    from service.cli import console
    from service.core.config import Settings

    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'tilde.db'}"))
    with TestClient(app, base_url="http://localhost") as client:
        sweep_id = store_dp_sweep(client, seed=7)
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
    assert any("speedup" in r["within_noise"] for r in rows)
    with live_server(app) as base:
        monkeypatch.setenv("RINGLAB_URL", base)
        monkeypatch.setattr(console.out, "width", 80)
        shown = CliRunner().invoke(cli.app, ["results", str(sweep_id)], catch_exceptions=False)
    assert shown.exit_code == 0, shown.stdout
    lines = shown.stdout.splitlines()
    assert any(line.rstrip().endswith("x ~") for line in lines), shown.stdout
    legend = [line for line in lines if line.startswith("~ within noise")]
    assert len(legend) == 1, shown.stdout
    assert "holds 1.00x" in shown.stdout.replace("\n", " "), shown.stdout
