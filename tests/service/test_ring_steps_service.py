"""Where the time goes, through the service: a CPU ring sweep on the local Ray stores every
step, the API and the report show the exposed-communication share recomputed here from those
steps, the run page draws the timeline, and a `profile: true` run's Chrome traces download
through the API, also after a restart; a missing artifact is a 404."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _gang_helpers import run_queue

from service.artifacts import ArtifactStore
from workers.results import Artifact

API = "/api/v1"


def _share(steps: list[dict[str, Any]]) -> float:
    wait = sum(s["wait_s"] for s in steps)
    return wait / (wait + sum(s["compute_s"] for s in steps))


def _embedded(page: str, element_id: str) -> dict[str, Any]:
    found = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', page)
    assert found, f"no {element_id} figure on the page"
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_ring_sweep_stores_its_steps_and_profiles(tmp_path: Path, ray_session: Any) -> None:
    root = tmp_path / "artifacts"
    db = f"sqlite:///{tmp_path / 'steps.db'}"
    spec = {
        "name": "where the time goes",
        "base": {
            "kernel": "ring",
            "num_heads": 2,
            "head_dim": 16,
            "world_size": 2,
            "device": "cpu",
            "warmup": 1,
            "iterations": 3,
            "timeout_s": 120,
        },
        "grid": {"seq_len": [512, 2048], "profile": [False, True]},
    }
    with api_client(db, artifact_root=str(root)) as client:
        created = client.post(f"{API}/sweeps", json=spec)
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        store = ArtifactStore(str(root), 64 << 20, 256 << 20)
        run_queue(client.app.state.sessionmaker, store)

        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        assert [r["status"] for r in rows] == ["succeeded"] * 4, [r["error"] for r in rows]
        for row in rows:
            steps = client.get(f"{API}/runs/{row['run_id']}/steps").json()
            # 2 ranks x 3 iterations x (forward steps 0, 1 + backward 0, 1, home) in forward
            # mode: forward only, 2 steps
            assert len(steps) == 2 * 3 * 2
            assert {(s["rank"], s["phase"]) for s in steps} == {(0, "forward"), (1, "forward")}
            assert row["exposed_comm_share"] == pytest.approx(_share(steps))
            k_and_v = 2 * (row["seq_len"] // 2) * 2 * 16 * 4  # one shard's K and V, fp32
            assert [s["received_bytes"] for s in steps if s["step"] == 0] == [k_and_v] * 6
            assert 0 < row["step_coverage"] <= 1
            # F/B from the raw numbers: F what the steps computed, B the slowest probed link
            ranks = client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
            its = len(ranks[0]["times_s"])
            flops = sum(r["flops"] for r in ranks)
            flops_per_s = flops * its / sum(r["step_compute_s"] for r in ranks)
            assert [r["link_probe_bytes"] for r in ranks] == [k_and_v] * 2
            link = min(r["link_probe_bytes_per_s"] for r in ranks)
            assert row["link_probe_bytes_per_s"] == pytest.approx(link)
            assert row["link_kind"] == "loopback (one host)"
            per_it = sum(r["step_received_bytes"] for r in ranks) / its
            expected = (row["seq_len"] // 2) * flops_per_s * per_it / (link * flops)
            assert row["crossover_basis"] == "step compute rate, probed link: loopback (one host)"
            assert row["crossover_tokens"] == pytest.approx(expected)

        report = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        assert "| Exposed comm |" in report
        assert "## Where the time goes (sequence-parallel kernels)" in report
        shown = f"{rows[0]['exposed_comm_share']:.0%}"
        assert any(
            line.startswith(f"| {rows[0]['label']} | 512 |") and shown in line
            for line in report.splitlines()
        )

        page = client.get(f"/runs/{rows[0]['run_id']}").text
        timeline = _embedded(page, "timeline")
        assert [t["name"] for t in timeline["data"]] == ["compute", "wait"]
        assert sorted(set(timeline["data"][0]["y"])) == ["rank 0", "rank 1"]
        assert "exposed communication" in page

        profiled = [
            r for r in rows if client.get(f"{API}/runs/{r['run_id']}").json()["config"]["profile"]
        ]
        assert len(profiled) == 2
        for row in profiled:
            listed = client.get(f"{API}/runs/{row['run_id']}/artifacts").json()
            assert [a["name"] for a in listed] == ["trace-rank0.json", "trace-rank1.json"]
            for a in listed:
                got = client.get(a["url"])
                assert got.status_code == 200 and a["size_bytes"] == len(got.content)
                assert isinstance(json.loads(got.content)["traceEvents"], list)
            assert "trace-rank1.json" in client.get(f"/runs/{row['run_id']}").text
        unprofiled = next(r["run_id"] for r in rows if r not in profiled)
        assert client.get(f"{API}/runs/{unprofiled}/artifacts").json() == []

    # a restarted service finds them where the scheduler wrote them
    run_id = profiled[0]["run_id"]
    with api_client(db, artifact_root=str(root)) as client:
        url = f"{API}/runs/{run_id}/artifacts/trace-rank0.json"
        assert json.loads(client.get(url).content)["traceEvents"]
        (root / "runs" / str(run_id) / "trace-rank0.json").unlink()
        gone = client.get(url)
        assert gone.status_code == 404 and "file is not there" in gone.json()["detail"]
        assert client.get(f"{API}/runs/{run_id}/artifacts/nothing.json").status_code == 404
        assert client.get(f"{API}/runs/999999/artifacts").status_code == 404
        assert client.get(f"{API}/runs/{run_id}/artifacts/..%2Fsecrets").status_code in (404, 422)


def test_artifact_caps_refuse_with_the_reason(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path), max_bytes=10, run_max_bytes=15)

    def art(name: str, size: int) -> Artifact:
        return Artifact(name=name, kind="chrome_trace", rank=0, size_bytes=size, data=b"x" * size)

    rows = store.write(7, [art("a.json", 8), art("b.json", 11), art("c.json", 8)])
    assert [r["location"] is not None for r in rows] == [True, False, False]
    assert "over the 10-byte cap of one artifact" in rows[1]["refused"]
    assert "over the 15-byte cap per run" in rows[2]["refused"]
    assert (tmp_path / "runs" / "7" / "a.json").read_bytes() == b"x" * 8


def test_any_fsspec_url_is_an_artifact_root() -> None:
    from service.artifacts import read_chunks

    store = ArtifactStore("memory://ringlab-test/artifacts", 1 << 20, 1 << 20)
    data = json.dumps({"traceEvents": []}).encode()
    (row,) = store.write(
        3, [Artifact(name="t.json", kind="chrome_trace", size_bytes=len(data), data=data)]
    )
    assert row["location"] == "memory:///ringlab-test/artifacts/runs/3/t.json"
    assert b"".join(read_chunks(row["location"])) == data


def test_an_artifact_that_cannot_be_written_is_refused_with_the_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the root's runs/ directory must go")
    store = ArtifactStore(str(blocker), 1 << 20, 1 << 20)
    renewed = []
    art = Artifact(name="t.json", kind="chrome_trace", size_bytes=2, data=b"{}")
    (row,) = store.write(5, [art], between=lambda: renewed.append(True))
    assert row["location"] is None and "could not be written" in row["refused"]
    assert renewed == [True]  # the lease is renewed before each write
