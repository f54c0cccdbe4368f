"""A kernel's facts come from its KernelSpec alone: a kernel registered for one test, under a
name nothing else spells, gets its reference, layout and plan resolution, communication
overlap, dense-baseline treatment and bench grid from the fields it declares."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import attention
from attention.registry import (
    BenchParams,
    CommOverlap,
    Exact,
    bench_cpu_grid,
    bench_gpu_grid,
    exact_of,
)
from service.results import baselines, schemes
from workers import references, resolved

BUILT_IN = {name for name, spec in attention.KERNELS.items() if spec.plugin is None}


@pytest.fixture
def twin_of_dilated(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`dilated` under a second name, declaring dilated's exact output and a bench grid."""
    spec = dataclasses.replace(
        attention.KERNELS["dilated"],
        name="_dilated_again",
        bench_params=BenchParams(cpu=({"segment_lengths": [8], "dilation_rates": [1]},)),
    )
    monkeypatch.setitem(attention.KERNELS, spec.name, spec)
    yield spec.name


@pytest.fixture
def sharded(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`ring` under a second name whose None layout is striped and whose transfers block."""
    spec = dataclasses.replace(
        attention.KERNELS["ring"],
        name="_ring_striped",
        default_layout=lambda layout, causal: layout or "striped",
        comm_overlap=CommOverlap.BLOCKING,
        dense_baseline=False,
    )
    monkeypatch.setitem(attention.KERNELS, spec.name, spec)
    yield spec.name


def test_the_reference_is_the_declared_kind(twin_of_dilated: str) -> None:
    params = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        got = references.reference_for(twin_of_dilated, params)(q, k, v, causal)
        want = references.reference_for("dilated", params)(q, k, v, causal)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert references.describe(twin_of_dilated, params).startswith("dense attention on")


def test_a_kernel_without_a_declared_reference_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = dataclasses.replace(attention.KERNELS["dilated"], name="_unchecked", exact=None)
    monkeypatch.setitem(attention.KERNELS, spec.name, spec)
    with pytest.raises(ValueError, match=r"no exact reference for kernel '_unchecked' \(supported: "
                       r"block_sparse, dense, dilated and their ring variants\)"):  # fmt: skip
        references.reference_for(spec.name, {"segment_lengths": [4], "dilation_rates": [1]})


def test_layout_and_plan_resolve_from_the_declaration(sharded: str, twin_of_dilated: str) -> None:
    assert resolved.resolved_params(sharded, {"layout": None}, causal=True, device="cpu") == {
        "layout": "striped"
    }
    assert resolved.as_given(sharded, {"layout": "striped"}, causal=True, device="cpu") == {}
    planned = resolved.resolved_params(
        twin_of_dilated, {"plan": "auto"}, causal=False, device="cuda"
    )
    assert planned == {"plan": "cuda"}


def test_the_overlap_decides_the_prediction(sharded: str) -> None:
    row = {"kernel": sharded, "median_s": 3.0, "flops_per_s_per_rank": 2.0,
           "step_flops_per_s_per_rank": 3.0, "comm_bytes_per_rank": 4.0,
           "link_probe_bytes_per_s": 2.0}  # fmt: skip
    assert schemes.predicted_s(row) == 2.0 + 2.0  # blocking: compute + transfers
    assert schemes.predicted_s({**row, "kernel": "ring"}) == 2.0  # overlapped: the larger


def test_the_schemes_and_dense_kernels_are_the_declared_ones() -> None:
    assert set(schemes.SCHEMES) == {"ring", "ulysses", "allgather_kv", "usp", "torch_cp"}
    assert {"dense", "ring", "multihead"} == baselines.DENSE_KERNELS
    assert attention.exact_dense() == "dense"


def test_exact_dense_refuses_two_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(attention.KERNELS, "_dense_again", attention.KERNELS["dense"])
    with pytest.raises(RuntimeError, match="expected one exact dense kernel"):
        attention.exact_dense()


def test_the_bench_grids_are_the_declared_ones(twin_of_dilated: str) -> None:
    cpu = bench_cpu_grid()
    assert list(cpu) == ["dense", "dilated", twin_of_dilated, "block_sparse"]
    assert cpu[twin_of_dilated] == [{"segment_lengths": [8], "dilation_rates": [1]}]
    assert [len(cpu[k]) for k in ("dense", "dilated", "block_sparse")] == [1, 1, 4]
    gpu = bench_gpu_grid()
    assert list(gpu) == ["dense", "dilated", "block_sparse", "ring", "ring_dilated",
                         "ring_block_sparse"]  # fmt: skip
    assert {gpu[k] == {} for k in ("dense", "ring", "ring_dilated", "ring_block_sparse")} == {True}


def test_every_built_in_single_process_kernel_has_a_reference() -> None:
    for name in BUILT_IN:
        spec = attention.KERNELS[name]
        if spec.distributed or spec.input_layout == "bse":
            continue
        assert isinstance(spec.exact, Exact), name


def test_a_ring_kernel_has_its_twins_kind_of_exact_output() -> None:
    kinds = {name: exact_of(name) for name in ("ring", "ring_dilated", "ring_block_sparse")}
    assert kinds == {"ring": Exact.DENSE, "ring_dilated": Exact.DILATED,
                     "ring_block_sparse": Exact.BLOCKS}  # fmt: skip
    assert exact_of("multihead") is None and exact_of("_no_such_kernel") is None
