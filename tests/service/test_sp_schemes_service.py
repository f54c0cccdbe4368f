"""ulysses, allgather_kv and usp through the service: bad heads or degrees are a 422 naming the
field, and a correctness-gated sweep of all three runs on a real local Ray gang of 2 ranks,
each storing its steps with the collectives' bytes as communication."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client

from service.scheduler import Scheduler
from service.sp_report import sp_schemes_section
from workers.gang import GangPool

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


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_the_schemes_run_gated_on_a_ray_gang(tmp_path: Path, ray_session: Any) -> None:
    spec = {
        "name": "schemes",
        "base": {**BASE, "seq_len": 256},
        "grid": {"kernel": ["allgather_kv", "ulysses", "usp"]},
    }
    with api_client(f"sqlite:///{tmp_path / 'sp.db'}") as client:
        created = client.post(f"{API}/sweeps", json=spec)
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        pool = GangPool(placement_timeout_s=120)
        scheduler = Scheduler(client.app.state.sessionmaker, pool=pool, lease_s=60, heartbeat_s=5)
        try:
            while scheduler.run_once():
                pass
        finally:
            pool.close()
        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        assert [r["status"] for r in rows] == ["succeeded"] * 3, [r["error"] for r in rows]
        for row in rows:
            assert row["max_abs_error"] is not None and row["max_abs_error"] < 1e-4, row
            steps = client.get(f"{API}/runs/{row['run_id']}/steps").json()
            assert sum(s["sent_bytes"] for s in steps) > 0
            assert 0 <= row["exposed_comm_share"] < 1
        # report.md's schemes section, recomputed from results.json
        section = sp_schemes_section(rows)
        assert section[0] == "## Sequence-parallel schemes side by side"
        assert len([line for line in section if f"| 256 | 2 | {rows[0]['mode']} |" in line]) == 3
        assert sum("**fastest**" in line for line in section) == 1
        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        assert "\n".join(section) in report


def test_the_schemes_section_ranks_each_length_and_shows_each_searched_maximum() -> None:
    shape = {"world_size": 4, "num_heads": 8, "num_kv_heads": 8, "head_dim": 32}
    shape |= {"dtype": "float32", "causal": True, "mode": "train", "status": "succeeded"}

    def row(kernel: str, median_s: float | None, max_seq_len: int | None = None) -> dict:
        return {**shape, "kernel": kernel, "seq_len": 2048, "measured_seq_len": 2048,
                "median_s": median_s, "tokens_per_s": None if median_s is None else 2048 / median_s,
                "rank_peak_bytes": [3 << 20, 5 << 20], "exposed_comm_share": 0.25,
                "max_seq_len": max_seq_len}  # fmt: skip

    rows = [row("ring", 0.4), row("ulysses", 0.2), row("allgather_kv", None, 8192)]
    assert sp_schemes_section(rows[:1] + rows[2:]) == []  # one timed scheme: nothing to compare
    section = sp_schemes_section([*rows, {**row("usp", 0.1), "world_size": 1}])
    table = [line for line in section if line.startswith("| 2,048")]
    assert table == [
        "| 2,048 | 4 | train | ulysses | 200.0 ms | 10,240 | 5.0 MiB | 25.0% | - | **fastest** |",
        "| 2,048 | 4 | train | ring | 400.0 ms | 5,120 | 5.0 MiB | 25.0% | - | x2.00 |",
    ]
    rows.append(row("allgather_kv", 0.3))
    (line,) = [x for x in sp_schemes_section(rows) if "allgather_kv" in x]
    assert line.endswith("| 8,192 | x1.50 |")
