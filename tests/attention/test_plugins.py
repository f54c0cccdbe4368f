"""Kernel plugins (entry points `ringlab.kernels`): the example plugin and the test fixtures,
installed in the test environment by `make test` (examples/plugin, tests/plugins), are listed,
validated, gated and run through the service like our own kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client
from _gang_helpers import run_queue
from _workers_helpers import config

import attention
from workers import protocol

API = "/api/v1"


def test_the_installed_plugins_are_listed_with_their_package_or_their_error(
    tmp_path: Path,
) -> None:
    with api_client(f"sqlite:///{tmp_path / 'k.db'}") as client:
        kernels = {k["name"]: k for k in client.get(f"{API}/kernels").json()}
    example = kernels["sliding_window"]
    assert example["available"] and example["error"] is None
    assert (example["package"], example["version"]) == ("ringlab-example-kernel", "0.1.0")
    assert example["params_schema"]["properties"]["window"]["default"] == 256
    assert kernels["dense"]["package"] is None  # ours
    broken = kernels["broken_kernel"]
    assert not broken["available"] and broken["params_schema"] is None
    assert broken["package"] == "ringlab-test-plugins"
    assert "ImportError" in broken["error"] and "not-installed-anywhere" in broken["error"]


def _sweep(kernel: str, params: dict[str, Any], seq_len: int = 256) -> dict[str, Any]:
    base = {"kernel": kernel, "params": params, "num_heads": 2, "head_dim": 16, "device": "cpu"}
    base |= {"warmup": 0, "iterations": 2, "mode": "train", "causal": True}
    return {"name": f"plugin {kernel}", "base": base, "grid": {"seq_len": [seq_len]}}


def test_a_sweep_naming_a_broken_plugin_or_a_bad_param_is_a_422(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 'k.db'}") as client:
        r = client.post(f"{API}/sweeps", json=_sweep("broken_kernel", {}))
        assert r.status_code == 422
        (error,) = r.json()["detail"]
        assert error["loc"][-1] == "kernel"
        assert "unavailable" in error["msg"] and "not-installed-anywhere" in error["msg"]
        r = client.post(f"{API}/sweeps", json=_sweep("sliding_window", {"window": 0}))
        assert r.status_code == 422
        (error,) = r.json()["detail"]
        assert error["loc"][-2:] == ["params", "window"] and ">= 1" in error["msg"]
        assert client.get(f"{API}/sweeps").json()["count"] == 0  # nothing stored


def test_a_plugin_kernel_always_passes_the_gate_and_counts_its_own_flops() -> None:
    cfg = config(
        kernel="sliding_window",
        params={"window": 40},
        seq_len=256,
        mode="train",
        correctness_check=False,
    )
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    assert case.result.max_abs_error is not None and case.result.max_abs_error <= 1e-4
    spec = attention.KERNELS["sliding_window"]
    keep = spec.keep_mask(spec.params(window=40), 256, False, "cpu")
    pairs = int(keep.sum()) * cfg.batch_size * cfg.num_heads
    assert case.result.flops == attention.attention_flops(pairs, cfg.head_dim, backward=True)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_plugin_sweeps_through_the_service(tmp_path: Path, ray_session: Any) -> None:
    """The example plugin's sweep succeeds; the plugin that drops the softmax scale, and the
    one wrong only at offset 200 of its 256-token window, are stopped by the correctness gate,
    which the error names; the environment records the plugins, failed runs' too."""
    with api_client(f"sqlite:///{tmp_path / 'p.db'}", artifact_root=str(tmp_path)) as client:
        sweeps = [
            _sweep("sliding_window", {"window": 64}),
            _sweep("unscaled_dense", {}),
            _sweep("offset_window", {"window": 256}, seq_len=1024),
        ]
        ids = [client.post(f"{API}/sweeps", json=sweep).json()["id"] for sweep in sweeps]
        run_queue(client.app.state.sessionmaker)
        (good,) = client.get(f"{API}/sweeps/{ids[0]}/results.json").json()
        assert good["status"] == "succeeded" and good["max_abs_error"] <= 1e-4, good["error"]
        env = client.get(f"{API}/runs/{good['run_id']}").json()["environment"]
        assert env["plugins"]["ringlab-example-kernel"] == "0.1.0"
        (bad,) = client.get(f"{API}/sweeps/{ids[1]}/results.json").json()
        assert bad["status"] == "failed"
        assert "correctness check failed" in bad["error"] and "unscaled_dense" in bad["error"]
        (offset,) = client.get(f"{API}/sweeps/{ids[2]}/results.json").json()
        assert offset["status"] == "failed" and "at 512 (every row)" in offset["error"]
        env = client.get(f"{API}/runs/{offset['run_id']}").json()["environment"]
        assert env["plugins"]["ringlab-test-plugins"] == "0.0.1"


def two_kernels_one_name() -> list[attention.KernelSpec]:
    """A plugin that registers the same name twice (the second would clash)."""
    spec = attention.KERNELS["sliding_window"]
    import dataclasses

    twin = dataclasses.replace(spec, name="clashing_kernel", plugin=None)
    return [twin, twin]


def test_a_plugin_that_fails_midway_registers_none_of_its_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib.metadata import EntryPoint

    from attention import plugins

    ep = EntryPoint(name="clashing_kernel", value=f"{__name__}:two_kernels_one_name",
                    group=plugins.GROUP)  # fmt: skip
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ep])
    try:
        plugins.load()
        assert "clashing_kernel" not in attention.KERNELS  # not half of a plugin
        assert "registered twice" in attention.UNAVAILABLE["clashing_kernel"].error
    finally:
        attention.UNAVAILABLE.pop("clashing_kernel", None)


def test_a_plugin_inside_a_layer_is_gated_too() -> None:
    from workers.kernels import gated

    off = {"correctness_check": False}
    layer = config(kernel="multihead", params={"kernel": "unscaled_dense"}, **off)
    assert gated(layer, "benchmark")
    assert not gated(config(kernel="multihead", params={"kernel": "dense"}, **off), "benchmark")
    assert gated(config(kernel="multihead", params={"kernel": "dense"}), "benchmark")


def test_a_dense_baseline_matches_whether_its_params_name_the_defaults_or_not() -> None:
    from service.results.baselines import _match_key

    old = {"kernel": "dense", "seq_len": 64, "params": {}}
    new = {"kernel": "dense", "seq_len": 64, "params": {"document_lengths": None}}
    assert _match_key(old) == _match_key(new)
    packed = {"kernel": "dense", "seq_len": 64, "params": {"document_lengths": [32, 32]}}
    assert _match_key(packed) != _match_key(new)
