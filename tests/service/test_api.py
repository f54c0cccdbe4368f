"""The REST API on SQLite and Postgres: submission, validation, listing, actions, exports, auth."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import httpx
import pytest
from _api_helpers import TOKEN, api_client, cluster_once_connected, small_spec, store_result
from _web_helpers import live_server
from sqlalchemy import func, select, update

from service.app import create_app
from service.core.config import Settings
from service.db.models import ProbeOutcome, RankResultRow, Run, RunStatus, Sweep

API = "/api/v1"


def _count(client: Any, model: type) -> int:
    with client.app.state.sessionmaker() as s:
        return s.scalar(select(func.count()).select_from(model))


def _set_status(client: Any, status: RunStatus, *run_ids: int) -> None:
    with client.app.state.sessionmaker() as s:
        s.execute(update(Run).where(Run.id.in_(run_ids)).values(status=status))
        s.commit()


def test_submit_is_idempotent_and_sweeps_list(database_url: str) -> None:
    with api_client(database_url) as client:
        spec = small_spec()
        r = client.post(f"{API}/sweeps", json=spec, headers={"Idempotency-Key": "k-1"})
        assert r.status_code == 201, r.text
        sweep = r.json()
        assert r.headers["location"] == f"{API}/sweeps/{sweep['id']}"
        assert sweep["total"] == 4 and sweep["counts"]["queued"] == 4
        assert sweep["progress"] == 0.0 and sweep["done"] is False

        again = client.post(f"{API}/sweeps", json=spec, headers={"Idempotency-Key": "k-1"})
        assert again.status_code == 200 and again.json()["id"] == sweep["id"]
        assert _count(client, Sweep) == 1 and _count(client, Run) == 4

        other = client.post(
            f"{API}/sweeps", json=small_spec("other"), headers={"Idempotency-Key": "k-1"}
        )
        assert other.status_code == 409 and "different spec" in other.json()["detail"]

        no_key = client.post(
            f"{API}/sweeps",
            json=small_spec("second", kind="correctness"),
            headers={"X-Ringlab-Submitter": "alice@lab"},
        )
        assert no_key.status_code == 201 and no_key.json()["submitter"] == "alice@lab"
        assert sweep["submitter"] == "anonymous"  # unnamed
        bad = client.post(
            f"{API}/sweeps", json=small_spec("x"), headers={"X-Ringlab-Submitter": "a b"}
        )
        assert bad.status_code == 422
        assert bad.json()["detail"][0]["loc"] == ["header", "x-ringlab-submitter"]

        listing = client.get(f"{API}/sweeps", params={"limit": 1}).json()
        assert listing["count"] == 2 and [s["name"] for s in listing["data"]] == ["second"]
        assert client.get(f"{API}/sweeps", params={"skip": 1}).json()["data"][0]["name"] == "small"
        kinds = client.get(f"{API}/sweeps", params={"kind": "correctness"}).json()
        assert kinds["count"] == 1 and kinds["data"][0]["kind"] == "correctness"
        named = client.get(f"{API}/sweeps", params={"name": "mal"}).json()
        assert [s["name"] for s in named["data"]] == ["small"]

        got = client.get(f"{API}/sweeps/{sweep['id']}").json()
        assert got["spec"]["grid"] == spec["grid"] and got["created_at"].endswith("Z")
        assert client.get(f"{API}/sweeps/{no_key.json()['id']}").json()["submitter"] == "alice@lab"
        assert client.get(f"{API}/sweeps/999999").status_code == 404


def test_invalid_spec_is_422_with_a_field_path_and_stores_nothing(database_url: str) -> None:
    with api_client(database_url) as client:
        bad = small_spec(grid={"seq_len": [128], "world_size": [1, 2]})
        bad["base"]["parallel"] = "sequence"
        r = client.post(f"{API}/sweeps", json=bad)
        assert r.status_code == 422
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "grid", "world_size", 1]
        assert (
            "runs in one process" in err["msg"] and "cell seq_len=128, world_size=2" in err["msg"]
        )

        r = client.post(f"{API}/sweeps", json=small_spec(base={"kernel": "nope", "seq_len": 64}))
        assert r.json()["detail"][0]["loc"] == ["body", "base", "kernel"]

        r = client.post(f"{API}/sweeps", json={"base": {"kernel": "dense"}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"]

        r = client.post(
            f"{API}/sweeps",
            json={
                "name": "big",
                "base": {"kernel": "dense"},
                "grid": {"seq_len": list(range(1, 401)), "batch_size": list(range(1, 401))},
            },
        )
        assert r.status_code == 422 and "160,000 cells" in r.json()["detail"][0]["msg"]
        assert _count(client, Sweep) == 0 and _count(client, Run) == 0


def test_values_any_database_could_not_hold_are_422_not_500(database_url: str) -> None:
    """NUL characters (Postgres stores none), coerced types and out-of-range ids or seeds are
    refused with their path on both databases; nothing is stored."""
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=small_spec("x\u0000"))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"]
        nul_env = small_spec()
        nul_env["base"]["env"] = {"NCCL_DEBUG": "IN\u0000FO"}
        r = client.post(f"{API}/sweeps", json=nul_env)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "base", "env", "NCCL_DEBUG"]

        for field, value in [("seq_len", "128"), ("causal", "yes"), ("warmup", 1.0)]:
            spec = small_spec(grid={"world_size": [1]})
            spec["base"] |= {"seq_len": 128, field: value}
            r = client.post(f"{API}/sweeps", json=spec)
            assert r.status_code == 422, (field, r.text)
            assert r.json()["detail"][0]["loc"][:3] == ["body", "base", field], r.text
        spec = small_spec()
        spec["base"]["seed"] = 2**40
        r = client.post(f"{API}/sweeps", json=spec)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "base", "seed"]
        assert _count(client, Sweep) == 0 and _count(client, Run) == 0

        assert client.get(f"{API}/sweeps", params={"name": "a\x00"}).status_code == 422
        assert client.get(f"{API}/runs", params={"kernel": "a\x00"}).status_code == 422
        for path in ("/sweeps/99999999999", "/runs/99999999999", "/?page=10000000000000"):
            assert client.get(path).status_code == 422, path
        assert client.get("/compare", params={"a": 10**12, "b": 1}).status_code == 422
        assert client.get("/sweeps/7").status_code == 404


def test_runs_filters_sort_and_pagination(database_url: str) -> None:
    with api_client(database_url) as client:
        spec = small_spec(grid={"seq_len": [128, 256, 512], "world_size": [1, 2]})
        sweep_id = client.post(f"{API}/sweeps", json=spec).json()["id"]
        other = client.post(f"{API}/sweeps", json=small_spec("other")).json()["id"]

        page = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "limit": 4}).json()
        assert page["count"] == 6 and len(page["data"]) == 4
        assert [r["id"] for r in page["data"]] == sorted(
            (r["id"] for r in page["data"]), reverse=True
        )

        r = client.get(
            f"{API}/runs",
            params={"sweep_id": sweep_id, "seq_len_min": 200, "world_size": 2, "sort": "seq_len"},
        ).json()
        assert [(x["seq_len"], x["world_size"]) for x in r["data"]] == [(256, 2), (512, 2)]

        first_id = page["data"][0]["id"]
        _set_status(client, RunStatus.running, first_id)
        running = client.get(f"{API}/runs", params={"status": "running"}).json()
        assert [x["id"] for x in running["data"]] == [first_id]
        assert (
            client.get(f"{API}/runs", params={"kernel": "dense", "dtype": "float32"}).json()[
                "count"
            ]
            == 10
        )
        assert (
            client.get(f"{API}/runs", params={"sweep_id": other, "seq_len_max": 128}).json()[
                "count"
            ]
            == 2
        )
        assert client.get(f"{API}/runs", params={"sort": "config"}).status_code == 422
        assert client.get(f"{API}/runs", params={"status": "nope"}).status_code == 422
        assert client.get(f"{API}/runs", params={"limit": 0}).status_code == 422


def test_run_detail_exports_and_report(database_url: str) -> None:
    with api_client(database_url) as client:
        sweep_id = client.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "id"}).json()["data"]
        by_cell = {(r["seq_len"], r["world_size"]): r["id"] for r in runs}
        with client.app.state.sessionmaker() as s:
            store_result(s, by_cell[(128, 1)], medians=(0.004,), peak=3 << 20, flops=2e9)
            store_result(s, by_cell[(128, 2)], medians=(0.002, 0.0025), peak=2 << 20, flops=1e9)
            store_result(
                s,
                by_cell[(256, 1)],
                status=RunStatus.oom,
                medians=(),
                error="CUDA out of memory\nmore",
            )

        detail = client.get(f"{API}/runs/{by_cell[(128, 2)]}").json()
        assert [rr["rank"] for rr in detail["rank_results"]] == [0, 1]
        assert detail["environment"]["torch"] == "2.13.0+cpu"
        assert detail["headline"]["median_s"] == pytest.approx(0.0025)
        assert detail["headline"]["tokens_per_s"] == pytest.approx(2 * 128 / 0.0025)
        assert detail["headline"]["tflops_per_s"] == pytest.approx(2e9 / 0.0025 / 1e12)
        assert detail["config"]["parallel"] == "data"
        assert client.get(f"{API}/runs/999999").status_code == 404

        rows = client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
        assert len(rows) == 4
        row = next(r for r in rows if r["run_id"] == by_cell[(128, 2)])
        assert row["peak_memory_bytes"] == (2 << 20) + 1 and row["outcome"] == "ok (not checked)"
        assert next(r for r in rows if r["run_id"] == by_cell[(256, 1)])["outcome"] == "OOM"

        text = client.get(f"{API}/sweeps/{sweep_id}/results.csv").text
        table = list(csv.DictReader(io.StringIO(text)))
        assert len(table) == 4
        csv_row = next(r for r in table if r["run_id"] == str(by_cell[(128, 1)]))
        assert float(csv_row["median_s"]) == pytest.approx(0.004)
        assert float(csv_row["tokens_per_s"]) == pytest.approx(2 * 128 / 0.004)

        report = client.get(f"{API}/sweeps/{sweep_id}/report.md")
        assert report.headers["content-type"].startswith("text/markdown")
        md = report.text
        assert md.startswith("# small\n")
        assert "## Results per run and sequence length" in md
        # per-rank peaks in their own columns; 4 ms -> 2.5 ms on 2 ranks: 1.60x, 80% efficient.
        assert "| dense · W=2 | 128 | 2 | 2.50 ms | 2.25 ms - 2.75 ms | 102,400 |" in md
        # the intervals: stored times are median x (0.9, 1, 1.1), so speedup 3.6/2.75-4.4/2.25
        lo, hi = 0.004 * 0.9 / (0.0025 * 1.1), 0.004 * 1.1 / (0.0025 * 0.9)
        assert (
            f"| 2.00 MiB | 2.00 MiB | 16.00 KiB | W=1 | 1.60x ({lo:.2f}-{hi:.2f}) | 0.67x | "
            f"80% ({lo / 2:.0%}-{hi / 2:.0%}) | ok (not checked) |" in md
        )
        assert "## Time by seq len and world size" in md and "| 128 | 4.00 ms | 2.50 ms |" in md
        assert "## Environment" in md and "2.13.0+cpu" in md
        # a sweep with failures shows its errors before its tables
        assert md.index("## Errors") < md.index("## Results")
        assert "CUDA out of memory" in md and "| OOM |" in md


def test_report_max_seq_len_table(database_url: str) -> None:
    with api_client(database_url) as client:
        spec = {
            "name": "max len",
            "kind": "max_seq_len",
            "base": {"kernel": "dense", "parallel": "data", "batch_size": 2, "num_heads": 2},
            "grid": {"world_size": [1, 2]},
            "search": {"start": 1024, "max": 8192, "granularity": 1024},
        }
        sweep_id = client.post(f"{API}/sweeps", json=spec).json()["id"]
        runs = client.get(f"{API}/runs", params={"sweep_id": sweep_id, "sort": "world_size"}).json()
        one, two = (r["id"] for r in runs["data"])
        fit, oom = ProbeOutcome.fit, ProbeOutcome.oom
        with client.app.state.sessionmaker() as s:
            store_result(s, one, medians=(0.5,), probes=((1024, fit, 1 << 20), (2048, oom, None)))
            store_result(
                s, two, medians=(0.5, 0.6), probes=((2048, fit, 1 << 21), (4096, oom, None))
            )
        md = client.get(f"{API}/sweeps/{sweep_id}/report.md").text
        assert "## Maximum sequence length" in md
        # Time and tokens/s at the answer (2 x 1024 tokens / 0.5 s), 1 MiB / (2 x 1024 tokens).
        assert "| dense · W=1 | 1 | 1,024 | 500.00 ms | 4,096 | 1.00 MiB | - | 512 B |" in md
        # W=2 vs W=1: 2x the maximum length on 2 ranks is 100% efficient.
        assert "| 2,048 | 600.00 ms | 6,827 | 1.00 MiB | 1.00 MiB | 512 B | W=1 |" in md
        assert "| 2.00x | 100% | ok (not checked) |" in md
        assert "| 1,024 | - | - | 1.00 MiB | fit | - |\n| 2,048 | - | - | - | OOM | - |" in md
        row = next(
            r
            for r in client.get(f"{API}/sweeps/{sweep_id}/results.json").json()
            if r["run_id"] == two
        )
        assert row["max_seq_len"] == 2048


def test_cancel_retry_delete(database_url: str) -> None:
    with api_client(database_url) as client:
        sweep_id = client.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        ids = [r["id"] for r in client.get(f"{API}/runs", params={"sort": "id"}).json()["data"]]
        _set_status(client, RunStatus.running, ids[0])
        _set_status(client, RunStatus.succeeded, ids[1])

        r = client.delete(f"{API}/sweeps/{sweep_id}")
        assert r.status_code == 409 and "cancel it first" in r.json()["detail"]

        r = client.post(f"{API}/sweeps/{sweep_id}/cancel").json()
        assert r["changed"] == 3
        assert r["sweep"]["counts"]["cancelled"] == 3 and r["sweep"]["done"] is True

        _set_status(client, RunStatus.failed, ids[0])
        _set_status(client, RunStatus.timed_out, ids[2])
        _set_status(client, RunStatus.oom, ids[3])
        with client.app.state.sessionmaker() as s:
            s.execute(update(Run).where(Run.id == ids[0]).values(attempts=3, error="boom"))
            s.commit()
            store_result(s, ids[0], status=RunStatus.failed, error="boom")
        r = client.post(f"{API}/sweeps/{sweep_id}/retry").json()
        assert r["changed"] == 2 and r["sweep"]["counts"]["queued"] == 2
        assert r["sweep"]["counts"]["oom"] == 1
        detail = client.get(f"{API}/runs/{ids[0]}").json()
        assert detail["status"] == "queued" and detail["attempts"] == 0 and detail["error"] is None
        assert detail["rank_results"] == []
        r = client.post(f"{API}/sweeps/{sweep_id}/retry", params={"include_oom": True}).json()
        assert r["changed"] == 1 and r["sweep"]["counts"]["queued"] == 3

        client.post(f"{API}/sweeps/{sweep_id}/cancel")
        assert client.delete(f"{API}/sweeps/{sweep_id}").status_code == 204
        assert client.get(f"{API}/sweeps/{sweep_id}").status_code == 404
        assert _count(client, Run) == 0 and _count(client, RankResultRow) == 0
        assert client.delete(f"{API}/sweeps/{sweep_id}").status_code == 404
        assert client.post(f"{API}/sweeps/{sweep_id}/cancel").status_code == 404


def _events(lines: Any) -> Any:
    event: dict[str, str] = {}
    for line in lines:
        if line.startswith("event:"):
            event["event"] = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            event["data"] = line.split(":", 1)[1].strip()
        elif not line and "event" in event:
            yield event["event"], json.loads(event["data"])
            event = {}


def test_events_stream_run_changes_and_end(database_url: str) -> None:
    app = create_app(Settings(database_url=database_url))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        sweep_id = http.post(f"{API}/sweeps", json=small_spec()).json()["id"]
        ids = [r["id"] for r in http.get(f"{API}/runs").json()["data"]]
        sm = app.state.sessionmaker
        with sm() as s:
            s.execute(update(Run).where(Run.id.in_(ids[1:])).values(status=RunStatus.succeeded))
            s.commit()
        url = f"{API}/sweeps/{sweep_id}/events"
        with http.stream("GET", url, params={"poll_s": 0.1}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _events(response.iter_lines())
            kind, first = next(events)
            assert kind == "progress" and first["counts"]["succeeded"] == 3
            with sm() as s:
                s.execute(update(Run).where(Run.id == ids[0]).values(status=RunStatus.running))
                s.commit()
            kind, run = next(events)
            assert (kind, run["id"], run["status"], run["previous"]) == (
                "run",
                ids[0],
                "running",
                "queued",
            )
            assert next(events)[0] == "progress"
            with sm() as s:
                s.execute(update(Run).where(Run.id == ids[0]).values(status=RunStatus.succeeded))
                s.commit()
            rest = list(events)
        assert [k for k, _ in rest] == ["run", "progress", "end"]
        assert rest[-1][1]["done"] is True and rest[-1][1]["progress"] == 1.0
        assert http.get(f"{API}/sweeps/999999/events").status_code == 404


MUTATING = {"POST", "PUT", "PATCH", "DELETE"}


def test_every_mutating_endpoint_requires_the_token(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    with api_client(url, api_token=TOKEN) as client:
        paths = client.get("/openapi.json").json()["paths"]
        routes = [
            (method.upper(), path)
            for path, operations in paths.items()
            for method in operations
            if method.upper() in MUTATING
        ]
        assert {(m, p.removeprefix(API)) for m, p in routes} >= {
            ("POST", "/sweeps"),
            ("POST", "/sweeps/{sweep_id}/cancel"),
            ("POST", "/sweeps/{sweep_id}/retry"),
            ("DELETE", "/sweeps/{sweep_id}"),
        }
        good = {"Authorization": f"Bearer {TOKEN}"}
        sweep_id = client.post(f"{API}/sweeps", json=small_spec(), headers=good).json()["id"]
        for method, path in routes:
            target = path.replace("{sweep_id}", str(sweep_id))
            body = small_spec("x") if target.endswith("/sweeps") else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                r = client.request(method, target, json=body, headers=headers)
                assert r.status_code == 401, (method, target, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
        assert _count(client, Sweep) == 1
        assert client.post(f"{API}/sweeps/{sweep_id}/cancel", headers=good).status_code == 200
        assert client.get(f"{API}/sweeps").status_code == 200  # reads stay open by default
        assert client.get(f"{API}/runs").status_code == 200

    with api_client(url, api_token=TOKEN, require_token_for_reads=True) as client:
        run_id = client.get(f"{API}/runs", headers=good).json()["data"][0]["id"]
        for path in (
            "/sweeps",
            "/runs",
            f"/sweeps/{sweep_id}",
            f"/sweeps/{sweep_id}/report.md",
            "/kernels",
            f"/runs/{run_id}/steps",
            f"/runs/{run_id}/artifacts",
        ):
            assert client.get(f"{API}{path}").status_code == 401, path
            assert client.get(f"{API}{path}", headers=good).status_code == 200, path
        assert client.get(f"{API}/healthz").status_code == 200  # liveness stays open


def test_body_limit_kernels_and_health(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'misc.db'}"
    app = create_app(Settings(database_url=url), max_body_bytes=4096)
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="http://localhost") as client:
        big = small_spec(description="x" * 5000)
        r = client.post(f"{API}/sweeps", json=big)
        assert r.status_code == 413 and "4,096 bytes" in r.json()["detail"]

        def chunks() -> Any:
            yield b'{"name": "' + b"x" * 3000
            yield b"y" * 3000 + b'"}'

        r = client.post(
            f"{API}/sweeps", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert _count(client, Sweep) == 0

        kernels = {k["name"]: k for k in client.get(f"{API}/kernels").json()}
        assert kernels["dense"]["distributed"] is False
        assert kernels["dense"]["params_schema"]["type"] == "object"
        assert client.get(f"{API}/healthz").json() == {"status": "ok", "checks": {}}
        ready = client.get(f"{API}/readyz").json()
        assert ready["checks"]["database"] == "ok"
        assert ready["checks"]["scheduler"] == "not embedded"


@pytest.mark.ray
def test_cluster_and_readyz_with_ray(tmp_path: Any, ray_session: Any) -> None:
    """An API-only process with RINGLAB_RAY_ADDRESS reports that cluster through its Ray
    driver; one with no address and no scheduler says it has none."""
    address = ray_session.get_runtime_context().gcs_address
    with api_client(f"sqlite:///{tmp_path / 'ray.db'}", ray_address=address) as client:
        cluster = cluster_once_connected(client.get)
        assert cluster["total_cpus"] >= 1 and cluster["nodes"][0]["cpus"] >= 1
        ready = client.get(f"{API}/readyz")
        assert ready.status_code == 200 and ready.json()["checks"]["ray"] == "ok"
    with api_client(f"sqlite:///{tmp_path / 'ray.db'}") as client:
        ready = client.get(f"{API}/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["ray"].startswith("not connected: this process runs no")


@pytest.mark.ray
def test_cluster_shows_what_idle_warm_gangs_hold(tmp_path: Any, ray_session: Any) -> None:
    """A finished run's gang stays warm for the next run and keeps its CPU: GET /cluster and
    `ringlab cluster` say so apart from what is free, and it is idle, not running anything."""
    from _workers_helpers import config, wait
    from typer.testing import CliRunner

    from service.cli import app as cli
    from workers.gang import GangPool

    pool = GangPool(placement_timeout_s=60)
    try:
        cfg = config(world_size=2, batch_size=2, parallel="data", device="cpu")
        outcome = wait(pool.start(cfg, "benchmark"))
        assert outcome.status == "succeeded", outcome.error
        address = ray_session.get_runtime_context().gcs_address
        app = create_app(
            Settings(database_url=f"sqlite:///{tmp_path / 'ray.db'}", ray_address=address)
        )
        with live_server(app) as base:
            info = cluster_once_connected(lambda path: httpx.get(f"{base}{path}"))
            assert (info["gang_cpus"], info["idle_gang_cpus"]) == (2, 2), info
            assert info["idle_gang_gpus"] == 0
            assert info["free_cpus"] == info["total_cpus"] - 2
            result = CliRunner().invoke(cli, ["cluster"], env={"RINGLAB_URL": base})
        assert result.exit_code == 0, result.output
        assert "held by idle warm gangs: 2 CPUs" in result.output
    finally:
        pool.close()
