"""Per-kernel params in one sweep: a `params` axis of whole params objects, zipped with
`kernel`, makes ring (zigzag) and ulysses (inner dense) cells of one sweep, which the compare
page pairs with the same cells of another sweep."""

from __future__ import annotations

import re
from typing import Any

from _api_helpers import TOKEN, api_client, store_result

API = "/api/v1"


def two_kernels(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "base": {"seq_len": 256, "num_heads": 4, "head_dim": 16, "world_size": 2},
        "zip": {
            "kernel": ["ring", "ulysses"],
            "params": [{"layout": "zigzag"}, {"inner": "dense"}],
        },
    }


def _runs(client: Any, sweep_id: int) -> dict[str, dict[str, Any]]:
    data = client.get(f"{API}/runs", params={"sweep_id": sweep_id}).json()["data"]
    return {r["kernel"]: r for r in data}


def test_each_kernel_takes_its_own_params_and_compare_pairs_them(database_url: str) -> None:
    with api_client(database_url, api_token=TOKEN) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        ids = []
        for name, seconds in (("today", 0.01), ("tomorrow", 0.02)):
            r = client.post(f"{API}/sweeps", json=two_kernels(name))
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
            runs = _runs(client, ids[-1])
            assert set(runs) == {"ring", "ulysses"}
            with client.app.state.sessionmaker() as s:
                for run in runs.values():
                    store_result(s, run["id"], medians=(seconds,))
                s.commit()
        a, b = ids
        ring = client.get(f"{API}/runs/{_runs(client, a)['ring']['id']}").json()
        ulysses = client.get(f"{API}/runs/{_runs(client, a)['ulysses']['id']}").json()
        assert ring["config"]["params"]["layout"] == "zigzag"
        assert ulysses["config"]["params"]["inner"] == "dense"

        pairs = client.get(f"{API}/sweeps/{a}/compare/{b}").json()["pairs"]
        by_run = {p["a_run_id"]: p["b_run_id"] for p in pairs}
        assert by_run == {_runs(client, a)[k]["id"]: _runs(client, b)[k]["id"] for k in runs}
        assert all(abs(p["time_ratio"] - 2.0) < 1e-9 for p in pairs)

        page = client.get("/compare", params={"a": a, "b": b})
        assert page.status_code == 200
        text = re.sub(r"<[^>]+>", " ", page.text)
        assert "ring" in text and "ulysses" in text


def test_a_params_object_that_is_not_the_kernels_is_refused_where_it_is(
    database_url: str,
) -> None:
    spec = two_kernels("bad")
    spec["zip"]["params"][1] = {"layout": "zigzag"}  # ulysses has no layout
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=spec)
        assert r.status_code == 422
        (error,) = r.json()["detail"]
        assert error["loc"] == ["body", "zip", "params", 1, "layout"]
        assert "unknown parameter of kernel 'ulysses'" in error["msg"]
        assert client.get(f"{API}/sweeps").json()["data"] == []
