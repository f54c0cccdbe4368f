"""The adapters of outside kernels (attention/adapters): sdpa with its backend named,
lucidrains' ring on gloo ranks behind the correctness gate (which catches its dK/dV bug), the
CUDA-only ones listed as unavailable here, and the CPU comparison sweep through the service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _api_helpers import api_client
from _dist_helpers import run_ranks
from _gang_helpers import run_queue
from _workers_helpers import config

import attention
from attention import layouts
from service.cli.specs import load_specs
from workers import protocol
from workers.references import _dense

API = "/api/v1"


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_sdpa_with_a_cpu_backend_passes_the_gate(backend: str) -> None:
    case = protocol.run_case(
        config(kernel="sdpa", params={"backend": backend}, mode="train", causal=True)
    )
    assert case.status == "ok", case.error
    assert case.result.max_abs_error is not None and case.result.max_abs_error <= 1e-4
    assert case.result.backend == f"sdpa-{backend}-cpu"


def test_sdpa_with_a_backend_the_device_lacks_is_an_error_naming_it() -> None:
    module = attention.build("sdpa", backend="efficient")
    q = torch.randn(1, 64, 2, 16)
    with pytest.raises(attention.ParamError) as refused:
        module(q, q, q)
    assert refused.value.path == ("params", "backend")
    assert "efficient backend does not run torch.float32 on cpu" in str(refused.value)


def test_the_cuda_adapters_are_listed_unavailable_with_the_missing_package() -> None:
    for name, module in (("flash_attn", "flash_attn"), ("ring_flash_attn", "ring_flash_attn")):
        bad = attention.UNAVAILABLE[name]
        assert bad.plugin.package == "ringlab"
        assert f"No module named '{module}'" in bad.error


def lucidrains_grads(rank: int, world: int, causal: bool) -> dict[str, float]:
    """lucidrains' ring against our einsum reference on this rank's shard: the errors of its
    output and gradients, and of its dK against the reference's dK + dV."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 256, 2, 16, generator=gen) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = _dense(*ref, causal)
    out_ref.backward(dout)
    pos = layouts.positions(256, "contiguous", rank, world)
    mine = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    out = attention.build("lucidrains_ring", bucket_size=64)(*mine, causal=causal)
    out.backward(dout[:, pos])

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().abs().max())

    dq_ref, dk_ref, dv_ref = (t.grad[:, pos] for t in ref)
    return {
        "out": err(out, out_ref[:, pos]),
        "dq": err(mine[0].grad, dq_ref),
        "dk": err(mine[1].grad, dk_ref),
        "dv": err(mine[2].grad, dv_ref),
        "dk_is_dk_plus_dv": err(mine[1].grad, dk_ref + dv_ref),
    }


@pytest.mark.parametrize("causal", [False, True])
def test_lucidrains_ring_has_a_right_forward_and_the_documented_dkv_bug(causal: bool) -> None:
    """reference.md: its backward unpacks (dk, dv) wrongly, so dK = dK + dV of the rank."""
    for errors in run_ranks(lucidrains_grads, 2, causal):
        assert errors["out"] < 1e-5 and errors["dq"] < 1e-4
        assert errors["dk"] > 0.1 and errors["dv"] > 0.1
        assert errors["dk_is_dk_plus_dv"] < 1e-4


def gated_case(rank: int, world: int, mode: str) -> tuple[str, str | None]:
    cfg = config(kernel="lucidrains_ring", params={"bucket_size": 64}, seq_len=256,
                 world_size=world, mode=mode)  # fmt: skip
    case = protocol.run_case(cfg, rank)
    return case.status, case.error


def test_the_gate_passes_lucidrains_forward_and_stops_its_training() -> None:
    assert [s for s, _ in run_ranks(gated_case, 2, "forward")] == ["ok", "ok"]
    for status, error in run_ranks(gated_case, 2, "train"):
        assert status == "failed"
        assert "correctness check failed" in error and "lucidrains_ring" in error


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_cpu_comparison_sweep_runs_with_speedups_relative_to_ours(
    tmp_path: Path, ray_session: Any
) -> None:
    (doc,) = load_specs("cpu-compare-rings.yaml")
    with api_client(f"sqlite:///{tmp_path / 'c.db'}", artifact_root=str(tmp_path)) as client:
        created = client.post(f"{API}/sweeps", json=doc)
        assert created.status_code == 201, created.text
        run_queue(client.app.state.sessionmaker)
        rows = client.get(f"{API}/sweeps/{created.json()['id']}/results.json").json()
    assert [r["status"] for r in rows] == ["succeeded"] * 4, [r["error"] for r in rows]
    ours = {r["seq_len"]: r for r in rows if r["kernel"] == "ring"}
    for r in rows:
        if r["kernel"] == "lucidrains_ring":
            base = ours[r["seq_len"]]
            assert r["baseline_run_id"] == base["run_id"]
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
            assert r["max_abs_error"] <= 1e-4  # gated, though the sweep did not ask


FLEX = [
    ("flex_block_sparse", {"block_size": 32, "pattern": "local_window", "window": 2}),
    ("flex_dilated", {"segment_lengths": [64, 256], "dilation_rates": [1, 2]}),
]


@pytest.mark.parametrize(("kernel", "params"), FLEX)
@pytest.mark.parametrize("causal", [False, True])
def test_flex_runs_our_patterns_and_passes_the_gate(
    kernel: str, params: dict, causal: bool
) -> None:
    """Eager here (compiling each case costs seconds); the compiled path has its own test."""
    cfg = config(kernel=kernel, params={**params, "compiled": False}, seq_len=256,
                 num_heads=4, causal=causal)  # fmt: skip
    case = protocol.run_case(cfg)
    assert case.status == "ok", case.error
    assert case.result.max_abs_error is not None and case.result.max_abs_error <= 1e-4
    ours = attention.build(kernel.removeprefix("flex_"), **params)
    assert case.result.flops == ours.flops(1, 256, 4, 16, causal)


def test_compiled_flex_equals_ours_and_says_what_cpu_cannot_do() -> None:
    q, k, v = (torch.randn(1, 128, 2, 16) for _ in range(3))
    sparse = {"block_size": 32, "pattern": "local_window", "window": 2}
    flex = attention.build("flex_block_sparse", **sparse)  # compiled: the default where torch can
    got = flex(q, k, v)
    assert flex.backend == "flex-compiled"
    want = attention.build("block_sparse", **sparse)(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    dilated = {"segment_lengths": [64, 128], "dilation_rates": [1, 2]}
    with pytest.raises(attention.ParamError, match="cannot return the log-sum-exp"):
        attention.build("flex_dilated", **dilated, compiled=True)(q, k, v)
    with pytest.raises(ValueError, match="no backward on CPU"):
        attention.build("flex_block_sparse", **sparse)(q.requires_grad_(), k, v)


def test_flex_dilated_refuses_the_plan_it_would_ignore() -> None:
    """dilated's `plan` reaches flex_dilated's params by inheritance; only auto is taken."""
    assert attention.build("flex_dilated").params.plan == "auto"
    with pytest.raises(attention.ParamError, match=r"^params\.plan: is dilated's"):
        attention.build("flex_dilated", plan="cpu")
