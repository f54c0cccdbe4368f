"""Hostile requests against POST /api/v1/sweeps (issue 42): no request costs the API more than
its size warrants, and every hostile input answers 422 naming the field, with nothing stored."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _api_helpers import api_client

import attention.block_sparse as block_sparse

ISSUE_POST = (
    '{"name":"bs","base":{"kernel":"block_sparse","seq_len":16384,"device":"cpu",'
    '"params":{"block_size":1,"pattern":"local_window","sparsity_ratio":0.5}}}'
)


def _vm_kib(field: str) -> int:
    """VmRSS or VmHWM of this process, in KiB, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def test_the_issues_block_sparse_post_costs_under_a_second_and_50_mb(tmp_path: Path) -> None:
    """Validation counts the pattern's pairs from its formula: the (n, n) mask of 16,384 blocks
    (256 MiB of bools, 1 GiB as floats) is never built, nor cached, in the API process."""
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here
        rss = _vm_kib("VmRSS")
        start = time.perf_counter()
        r = client.post(
            "/api/v1/sweeps", content=ISSUE_POST, headers={"content-type": "application/json"}
        )
        took = time.perf_counter() - start
        peak_mib = (_vm_kib("VmHWM") - rss) / 1024
        kept_mib = (_vm_kib("VmRSS") - rss) / 1024
        print(f"block_sparse POST: {took:.3f} s, peak +{peak_mib:.1f} MiB, kept +{kept_mib:.1f}")
        assert r.status_code == 201, r.text
        assert took < 1.0, f"{took:.2f} s"
        assert peak_mib < 50, f"the resident set peaked {peak_mib:.0f} MiB above its start"
        assert block_sparse._cached_block_mask.cache_info().currsize == 0


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_a_million_blocks_is_a_201_or_a_named_422_never_a_500(tmp_path: Path, ratio) -> None:
    base = {"kernel": "block_sparse", "seq_len": 1 << 20, "device": "cpu"}
    params = {"block_size": 1, "pattern": "local_window", "sparsity_ratio": ratio}
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        start = time.perf_counter()
        r = client.post("/api/v1/sweeps", json={"name": "big", "base": {**base, "params": params}})
        assert time.perf_counter() - start < 1.0
        assert r.status_code in (201, 422), r.text
        assert r.status_code == 201 or "params" in str(r.json()["detail"][0]["loc"])


def test_an_unreachable_ratio_still_names_the_nearest_density(tmp_path: Path) -> None:
    """global_local with 8 global blocks of 16 cannot go below (8*16 + 8*8 + 8) / 256."""
    params = {"block_size": 64, "pattern": "global_local", "num_global": 8, "sparsity_ratio": 0.1}
    base = {"kernel": "block_sparse", "seq_len": 1024, "device": "cpu", "params": params}
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post("/api/v1/sweeps", json={"name": "g", "base": base})
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"][-1] == "sparsity_ratio", err
        assert "cannot reach density 0.1 within one block per row" in err["msg"]
        assert "(16 blocks); nearest is 0.7812" in err["msg"], err["msg"]
        assert client.get("/api/v1/sweeps").json()["count"] == 0


DENSE = {"kernel": "dense", "seq_len": 64, "num_heads": 2, "head_dim": 16, "device": "cpu"}


@pytest.mark.parametrize(
    ("env", "named", "why"),
    [
        ({"NCCL_A=B": "1"}, "'NCCL_A=B'", "is no environment variable name"),
        ({"NCCL_debug": "1"}, "'NCCL_debug'", "is no environment variable name"),
        ({"NCCL_É": "1"}, "'NCCL_É'", "is no environment variable name"),
        ({"NCCL_DEBUG": "INFO\nNCCL_X=1"}, "NCCL_DEBUG", "no NUL, CR or LF"),
    ],
)
def test_env_names_and_values_ray_cannot_start_are_422_naming_the_key(
    tmp_path: Path, env, named, why
) -> None:
    """Ray fails to start a rank with an illegal variable name, and the run hung 360 s."""
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post("/api/v1/sweeps", json={"name": "e", "base": {**DENSE, "env": env}})
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "base", "env"], err
        assert named in err["msg"] and why in err["msg"], err["msg"]
        assert client.get("/api/v1/sweeps").json()["count"] == 0
        ok = {**DENSE, "env": {"NCCL_SOCKET_IFNAME": "lo", "NCCL_P2P_LEVEL": "NVL"}}
        assert client.post("/api/v1/sweeps", json={"name": "ok", "base": ok}).status_code == 201


def test_env_values_with_nul_are_refused_where_the_config_is_built() -> None:
    """The API refuses NUL in any string first (service.spec); the config refuses it itself
    for every other caller (the CLI's files, the scheduler's stored configs)."""
    from pydantic import ValidationError

    from workers.config import RunConfig

    with pytest.raises(ValidationError, match="NCCL_DEBUG: a value holds no NUL, CR or LF"):
        RunConfig.model_validate({**DENSE, "env": {"NCCL_DEBUG": "a\x00b"}})
