"""Hostile requests against POST /api/v1/sweeps (issue 42): no request costs the API more than
its size warrants, and every hostile input answers 422 naming the field, with nothing stored."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _api_helpers import api_client

from attention.block_sparse import params as bs_params

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
    bs_params._cached_block_mask.cache_clear()  # earlier tests in this process ran kernels
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
        assert bs_params._cached_block_mask.cache_info().currsize == 0


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


@pytest.mark.parametrize(
    ("field", "value", "cap"),
    [
        ("timeout_s", 1e308, "must be <= 86,400 (RINGLAB_MAX_TIMEOUT_S), got 1e+308"),
        ("dist_timeout_s", 1e6, "must be <= 86,400 (RINGLAB_MAX_TIMEOUT_S), got 1,000,000"),
        ("iterations", 10**9, "must be <= 10,000 (RINGLAB_MAX_ITERATIONS), got 1,000,000,000"),
        ("warmup", 10**6, "must be <= 1,000 (RINGLAB_MAX_WARMUP), got 1,000,000"),
        ("batch_size", 2**40, "must be <= 65,536 (RINGLAB_MAX_BATCH_SIZE)"),
        (
            "seq_len",
            2**40,
            "seq_len x num_heads x head_dim = 35,184,372,088,832 must be <= 1,099,511,627,776",
        ),
    ],
)
def test_runs_are_bounded_by_the_services_caps(tmp_path: Path, field, value, cap) -> None:
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post("/api/v1/sweeps", json={"name": "c", "base": {**DENSE, field: value}})
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "base", field], err
        assert cap in err["msg"], err["msg"]
        assert client.get("/api/v1/sweeps").json()["count"] == 0


def test_caps_follow_the_settings_and_name_the_axis_value(tmp_path: Path) -> None:
    """RINGLAB_MAX_* move the caps; an axis value over one is blamed at its place in the grid."""
    url = f"sqlite:///{tmp_path / 'ringlab.db'}"
    with api_client(url, max_iterations=50, max_cells=3, max_elements=64 * 2 * 16) as client:
        spec = {"name": "c", "base": DENSE, "grid": {"iterations": [10, 51]}}
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "grid", "iterations", 1], err
        assert "must be <= 50 (RINGLAB_MAX_ITERATIONS), got 51" in err["msg"], err["msg"]

        spec = {"name": "c", "base": DENSE, "grid": {"seed": [1, 2, 3, 4]}}
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422 and "the sweep has 4 cells; at most 3" in r.text, r.text

        search = {"start": 32, "max": 128, "granularity": 32}
        base = {k: v for k, v in DENSE.items() if k != "seq_len"}
        spec = {"name": "s", "kind": "max_seq_len", "base": base, "search": search}
        r = client.post("/api/v1/sweeps", json=spec)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "search", "max"], err
        assert "search.max x num_heads x head_dim = 4,096 must be <= 2,048" in err["msg"]
        assert client.get("/api/v1/sweeps").json()["count"] == 0
        auto = {"name": "a", "base": {**DENSE, "iterations": "auto"}}
        assert client.post("/api/v1/sweeps", json=auto).status_code == 201


# What a number beyond JSON's exact integers (JavaScript's safe range) is told.
WITHIN_2_53 = "must be within +-9,007,199,254,740,991 (2^53 - 1)"


def _dense(fields: str) -> str:
    """A sweep body (raw JSON) named n whose base is the dense kernel at length 64 plus
    `fields` (raw JSON members)."""
    return '{"name":"n","base":{"kernel":"dense","seq_len":64,' + fields + "}}"


@pytest.mark.parametrize(
    ("body", "loc", "why"),
    [
        ('{"name":"\\ud800","base":{}}', ["body", "name"], "unicode"),
        (
            _dense('"params":{"x\\udfff":1}'),
            ["body", "base", "params", "x\\udfff"],
            "key holds a lone surrogate (\\udfff)",
        ),
        (
            _dense('"env":{"NCCL_X":"\\ud800"}'),
            ["body", "base", "env", "NCCL_X"],
            "holds a lone surrogate (\\ud800) at character 0",
        ),
        (
            '{"name":"n","kind":"max_seq_len","base":{"kernel":"dense"},'
            '"search":{"start":64,"max":Infinity}}',
            ["body", "search", "max"],
            "finite",
        ),
        (
            '{"name":"n","base":{"workload":"model","kernel":"dense","seq_len":64,'
            '"model":{"d_model":64,"n_layers":1,"n_heads":2},"training":{"precision":["bf16"]}}}',
            ["body", "base", "training", "precision"],
            "Input should be 'fp32', 'bf16_autocast', 'fp16_autocast' or 'bf16'",
        ),
        (
            _dense('"timeout_s":NaN'),
            ["body", "base", "timeout_s"],
            "must be a finite number, got nan",
        ),
        (
            '{"name":"n","base":{"kernel":"block_sparse","seq_len":4096,"params":'
            '{"block_size":64,"pattern":"dilated","window":4611686018427387904}}}',
            ["body", "base", "params", "window"],
            WITHIN_2_53,
        ),
        (
            _dense('"batch_size":9223372036854775808'),
            ["body", "base", "batch_size"],
            WITHIN_2_53 + ", got 9.22e+18",
        ),
        (
            _dense('"params":{"a":' + "[" * 40 + "]" * 40 + "}"),
            ["body", "base", "params", "a", *[0] * 29],
            "nested deeper than 32 levels",
        ),
    ],
)
def test_every_hostile_input_is_a_422_naming_its_place(database_url: str, body, loc, why) -> None:
    """On SQLite and on Postgres (whose text and JSON refuse NUL and lone surrogates)."""
    with api_client(database_url) as client:
        r = client.post(
            "/api/v1/sweeps", content=body.encode(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, r.text
        err = r.json()["detail"][0]
        assert err["loc"] == loc and why in err["msg"], err
        assert client.get("/api/v1/sweeps").json()["count"] == 0


def test_error_lists_stop_at_20_and_count_the_rest(tmp_path: Path) -> None:
    """50,000 unknown axes (800 KB) once answered 20.8 MB: now 20 errors and a count."""
    grid = {f"x{i}": [1] for i in range(50_000)}
    body = {"name": "axes", "base": DENSE, "grid": grid}
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post("/api/v1/sweeps", json=body)
        assert r.status_code == 422
        detail = r.json()["detail"]
        assert len(detail) == 21 and len(r.content) < 30_000, len(r.content)
        assert (
            detail[0]["loc"] == ["body", "grid", "x0"] and "unknown axis 'x0'" in detail[0]["msg"]
        )
        assert detail[-1] == {
            "loc": ["body"],
            "msg": "49,980 more errors not shown (the first 20 are listed)",
            "type": "too_many_errors",
        }


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"name":"a","base":' + "[" * 200_000 + "]" * 200_000 + "}", "nests too deeply"),
        ('{"name":"a","base":{"seq_len":' + "9" * 5000 + "}}", "Exceeds the limit (4300 digits)"),
    ],
)
def test_a_body_json_cannot_parse_is_a_422_saying_why(tmp_path: Path, body, why) -> None:
    """FastAPI answers these with a bare 400 'There was an error parsing the body'."""
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post(
            "/api/v1/sweeps", content=body.encode(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body"] and why in err["msg"], err
        assert client.get("/api/v1/sweeps/999").json() == {"detail": "sweep 999 not found"}
        assert client.get("/api/v1/sweeps").json()["count"] == 0
