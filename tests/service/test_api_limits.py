"""Hostile sizes in a sweep's env and params: one 422 naming the field, nothing stored.

Every run stores its whole config, so an uncapped env value was written once per cell (a 0.5 MB
request over 200 cells wrote 103 MB)."""

from __future__ import annotations

from pathlib import Path

from _api_helpers import api_client

from workers.config import MAX_ENV_CHARS, MAX_PARAMS_CHARS

BASE = {"kernel": "dense", "seq_len": 64, "num_heads": 2, "head_dim": 16, "device": "cpu"}


def test_oversized_env_and_params_are_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        big_env = {"NCCL_DEBUG": "x" * 500_000}
        spec = {"name": "big", "base": {**BASE, "env": big_env}, "grid": {"seq_len": [64, 128]}}
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"][:3] == ["body", "base", "env"], err
        assert f"at most {MAX_ENV_CHARS} characters" in err["msg"] and "500000" in err["msg"]

        many = {f"NCCL_X{i}": "1" for i in range(100)}
        r = client.post("/api/v1/sweeps", json={"name": "many", "base": {**BASE, "env": many}})
        assert r.status_code == 422 and "at most 32 variables" in r.text

        params = {"segment_lengths": [2048] * 2000, "dilation_rates": [1] * 2000}
        spec = {"name": "p", "base": {**BASE, "kernel": "dilated", "params": params}}
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"][:3] == ["body", "base", "params"], err
        assert f"at most {MAX_PARAMS_CHARS} characters as JSON" in err["msg"]

        assert client.get("/api/v1/sweeps").json()["count"] == 0
        ok = {"name": "ok", "base": {**BASE, "env": {"NCCL_DEBUG": "INFO"}}}
        assert client.post("/api/v1/sweeps", json=ok).status_code == 201
