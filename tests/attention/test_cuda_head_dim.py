"""A head_dim that the fused CUDA op of the run's dtype cannot run is refused (issue 37 item
4.2): the primitive's rule (attention.primitive.cuda_head_dim_problem) or, where the kernel's
CUDA ops depend on its params (block_sparse's cuda plan, the flex adapters: compiled
FlexAttention), the kernel's own; a 422 naming head_dim for a device: cuda spec, and on
device auto the rank's check once its device resolved to CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _api_helpers import api_client

import attention
from attention.primitive import cuda_head_dim_problem

API = "/api/v1"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_flash_op_needs_a_multiple_of_8_up_to_256(dtype: torch.dtype) -> None:
    for ok in (8, 16, 64, 72, 128, 256):
        assert cuda_head_dim_problem(dtype, ok) is None, ok
    for bad in (1, 4, 12, 60, 100, 264, 512):
        problem = cuda_head_dim_problem(dtype, bad)
        assert problem is not None and f"{bad} does not run on CUDA" in problem, bad
        assert "multiple of 8 of at most 256" in problem


def test_float32_runs_the_efficient_op_which_has_no_rule() -> None:
    assert all(cuda_head_dim_problem(torch.float32, d) is None for d in (1, 12, 100, 264, 512))


def test_only_kernels_on_the_primitive_are_held_to_it() -> None:
    for name in ("ring", "dilated", "ring_dilated", "ring_block_sparse"):
        with pytest.raises(attention.ParamError) as caught:
            attention.check_cuda_head_dim(name, torch.bfloat16, 12)
        assert caught.value.path == ("head_dim",) and name in str(caught.value)
        attention.check_cuda_head_dim(name, torch.bfloat16, 64)
        attention.check_cuda_head_dim(name, torch.float32, 12)
    attention.check_cuda_head_dim("dense", torch.bfloat16, 12)  # SDPA pads the last dim
    attention.check_cuda_head_dim("sdpa", torch.bfloat16, 12)


def test_flexattention_kernels_are_held_to_its_least_head_dim_of_16() -> None:
    """block_sparse's cuda plan (auto's on CUDA) and the compiled flex adapters run compiled
    FlexAttention (head_dim >= 16, any multiple, any dtype); block_sparse's cpu plan and eager
    flex keep the primitive's rule and none."""
    runs = [
        ("block_sparse", {}),
        ("block_sparse", {"plan": "cuda"}),
        ("flex_block_sparse", {}),
        ("flex_block_sparse", {"compiled": True}),
        ("flex_dilated", {"segment_lengths": [4], "dilation_rates": [1]}),
    ]
    for name, params in runs:
        for dtype in (torch.bfloat16, torch.float32):
            with pytest.raises(attention.ParamError) as caught:
                attention.check_cuda_head_dim(name, dtype, 12, params)
            assert caught.value.path == ("head_dim",)
            assert f"{name}: 12 does not run on CUDA: compiled FlexAttention" in str(caught.value)
            for fine in (16, 20, 100, 128):
                attention.check_cuda_head_dim(name, dtype, fine, params)
    with pytest.raises(attention.ParamError, match="multiple of 8 of at most 256"):
        attention.check_cuda_head_dim("block_sparse", torch.bfloat16, 20, {"plan": "cpu"})
    attention.check_cuda_head_dim("block_sparse", torch.bfloat16, 8, {"plan": "cpu"})
    attention.check_cuda_head_dim("flex_block_sparse", torch.bfloat16, 8, {"compiled": False})


def test_a_wrapping_kernel_is_held_to_its_inner_kernels_rule() -> None:
    """ulysses runs its inner kernel on whole heads and multihead keeps the run's head_dim: the
    rule is the inner kernel's (block_sparse's flex: >= 16; dense's SDPA pads: none)."""
    sparse = {"block_size": 16}
    wrapped = [
        ("ulysses", {"inner": "block_sparse", **sparse}),
        ("multihead", {"kernel": "block_sparse", "kernel_params": sparse}),
    ]
    for name, params in wrapped:
        with pytest.raises(attention.ParamError, match="compiled FlexAttention"):
            attention.check_cuda_head_dim(name, torch.bfloat16, 8, params)
        attention.check_cuda_head_dim(name, torch.bfloat16, 20, params)  # flex: any >= 16
    with pytest.raises(attention.ParamError, match="multiple of 8 of at most 256"):
        attention.check_cuda_head_dim("ulysses", torch.bfloat16, 12, {"inner": "dilated"})
    attention.check_cuda_head_dim("ulysses", torch.bfloat16, 12, {"inner": "dense"})
    attention.check_cuda_head_dim("multihead", torch.bfloat16, 12, {"kernel": "dense"})


def _spec(device: str, head_dim: int, dtype: str = "bfloat16") -> dict[str, Any]:
    return {
        "name": "head-dim",
        "base": {
            "kernel": "ring",
            "num_heads": 2,
            "head_dim": head_dim,
            "dtype": dtype,
            "device": device,
            "warmup": 1,
            "iterations": 2,
        },
        "grid": {"seq_len": [128], "world_size": [1]},
    }


def test_a_cuda_spec_with_such_a_head_dim_is_422_naming_head_dim(database_url: str) -> None:
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=_spec("cuda", 12))
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"][-1] == "head_dim" and "12 does not run on CUDA in bfloat16" in err["msg"]
        block_sparse = _spec("cuda", 8)
        block_sparse["base"].update(kernel="block_sparse", params={"block_size": 16})
        r = client.post(f"{API}/sweeps", json=block_sparse)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"][-1] == "head_dim" and "compiled FlexAttention" in err["msg"]
        for fine in (_spec("cuda", 16), _spec("cuda", 12, "float32"), _spec("auto", 12)):
            r = client.post(f"{API}/sweeps", json=fine)
            assert r.status_code in (200, 201), r.text


def test_a_rank_whose_auto_device_resolves_to_cuda_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rank's check runs before anything touches the device (CUDA faked: no GPU here)."""
    from workers import protocol
    from workers.config import RunConfig

    config = RunConfig.model_validate(
        {**_spec("auto", 12)["base"], "seq_len": 128, "world_size": 1}
    )
    monkeypatch.setattr(protocol, "resolve_device", lambda _config: torch.device("cuda"))
    with pytest.raises(attention.ParamError, match=r"^head_dim: ring: 12 does not run on CUDA"):
        protocol.run_case(config)
