"""allgather_kv's `gather` through the API: `needed` is accepted in a sweep and stored, a value
the kernel does not know is a 422 at params.gather storing nothing, and the default `all` is
left out of what a cell says it was given (labels, matching) like every declared default."""

from __future__ import annotations

from typing import Any

from _api_helpers import api_client, refused

from workers import resolved

API = "/api/v1"
DOCS = {"kind": "documents", "causal": True, "lengths": [640, 384]}


def _sweep(params: dict[str, Any]) -> dict:
    base = {
        "kernel": "allgather_kv", "params": params, "num_heads": 2, "head_dim": 16,
        "world_size": 2, "causal": True, "warmup": 1, "iterations": 2,
    }  # fmt: skip
    return {"name": "gather", "base": base, "grid": {"seq_len": [1024]}}


def test_a_sweep_with_gather_needed_is_accepted_and_stored(database_url: str) -> None:
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=_sweep({"mask": DOCS, "gather": "needed"}))
        assert r.status_code == 201, r.text
        [run] = client.get(f"{API}/runs").json()["data"]
    assert run["config"]["params"]["gather"] == "needed"
    assert run["config"]["params"]["mask"] == DOCS


def test_an_unknown_gather_is_a_422_at_params_gather(database_url: str) -> None:
    with api_client(database_url) as client:
        problem = refused(client, _sweep({"gather": "some"}))
        assert problem["loc"] == ["body", "base", "params", "gather"]
        assert "must be one of all, needed, got 'some'" in problem["msg"]
        assert client.get(f"{API}/runs").json()["count"] == 0


def test_the_default_gather_is_not_part_of_what_a_cell_was_given() -> None:
    given = resolved.as_given(
        "allgather_kv", {"gather": "all", "mask": DOCS}, causal=True, device="cpu"
    )
    assert given == {"mask": DOCS}
    needed = resolved.as_given(
        "allgather_kv", {"gather": "needed", "mask": DOCS}, causal=True, device="cpu"
    )
    assert needed == {"gather": "needed", "mask": DOCS}
