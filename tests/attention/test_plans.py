"""attention.plans: the one `plan` rule of dilated, ring_dilated and block_sparse."""

from __future__ import annotations

import pytest
import torch

import attention
from attention import block_sparse, dilated, primitive
from attention.block_sparse import kernel as block_sparse_kernel
from attention.errors import ParamError
from attention.plans import PLANS, resolve_plan
from attention.ring import dilated as ring_dilated

PLANNED = ["dilated", "block_sparse"]


@pytest.mark.parametrize(
    ("device", "stands_for", "plan"),
    [("cpu", None, "cpu"), ("cuda", None, "cuda"), ("meta", None, "cpu"),
     ("meta", "cuda", "cuda"), ("meta", "cpu", "cpu")],
)  # fmt: skip
def test_auto_takes_the_device_type_and_meta_what_it_stands_for(
    device: str, stands_for: str | None, plan: str
) -> None:
    if stands_for is None:
        assert resolve_plan("auto", torch.device(device)) == plan
        return
    with primitive.meta_stands_for(stands_for):
        assert resolve_plan("auto", torch.device(device)) == plan


@pytest.mark.parametrize("given", ["cpu", "cuda"])
def test_a_given_plan_runs_on_any_device(given: str) -> None:
    for device in ("cpu", "cuda", "meta"):
        assert resolve_plan(given, torch.device(device)) == given


@pytest.mark.parametrize("kernel", PLANNED)
def test_every_planned_kernel_takes_the_same_plans_and_refuses_others_alike(kernel: str) -> None:
    assert attention.KERNELS[kernel].device_plan
    for plan in PLANS:
        assert attention.make_params(kernel, {"plan": plan}).plan == plan
    with pytest.raises(
        ParamError, match=r"^params\.plan: must be one of auto, cpu, cuda, got 'gpu'"
    ):
        attention.make_params(kernel, {"plan": "gpu"})


def test_the_kernels_resolve_through_the_one_rule() -> None:
    for module in (block_sparse, dilated, block_sparse_kernel, ring_dilated):
        assert module.resolve_plan is resolve_plan
