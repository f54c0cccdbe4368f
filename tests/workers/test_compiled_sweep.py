"""Compiled kernels with their GPU semantics on CPU (RINGLAB_COMPILE_BACKEND=eager): the device
check's block_sparse sweep through one rank process compiles each shape once, outside its
timed iterations, never falls back, and records what it compiled (issue 49 items 1-2)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from _workers_helpers import config

from attention import compiled
from service.cli.specs import load_specs
from service.spec import SweepSpec, expand
from workers import gate, protocol
from workers.config import RunConfig
from workers.results import CaseOutcome
from workers.search import run_search

SHRINK = 64
"""The GPU document's lengths and block over this: 256-1024 tokens, 2-token blocks."""


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Compiled kernels through torch.compile(backend="eager") on CPU, from an empty Dynamo
    cache (and left empty: no other test inherits these entries)."""
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _proof_cells() -> list[RunConfig]:
    """examples/gpu-proof.yaml's block_sparse document at CPU sizes, cell by cell in the
    sweep's order: its lengths and block over SHRINK, 2 heads of 16, the cuda plan forced
    (what `auto` picks on a GPU), float32 (the op's CPU math backward in bf16 misses the
    gate's 6e-2 at head_dim 16; one dtype either way, so the same graphs); pattern, sparsity,
    modes, warm-up and the gate as there."""
    doc = next(d for d in load_specs("gpu-proof.yaml") if d["base"]["kernel"] == "block_sparse")
    small = copy.deepcopy(doc)
    small["base"].update(num_heads=2, head_dim=16, dtype="float32", device="cpu", iterations=2)
    params = small["base"]["params"]
    params.update(block_size=params["block_size"] // SHRINK, plan="cuda")
    small["grid"]["seq_len"] = [n // SHRINK for n in doc["grid"]["seq_len"]]
    return [cell.config for cell in expand(SweepSpec.model_validate(small))]


def test_the_proof_sweeps_block_sparse_compiles_each_shape_once_and_never_falls_back(
    eager_compile: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Per cell: the gate's full check (128 tokens, once per mode for the whole sweep) and its
    sampled check at the run's length compile, each in the cell's grad mode (forward: no_grad,
    as its timed iterations run; train: inputs that require grad); the warm-up and the timed
    iterations reuse the sampled check's graph. 6 graphs in all (Dynamo's forward graphs:
    the eager backend compiles no backward). With the forward checks under grad mode, as
    before, each forward cell compiled one graph more: 3, 2, 2, 1 (8)."""
    cells = _proof_cells()
    assert [(c.seq_len, c.mode) for c in cells] == [
        (n, m) for n in (512, 1024) for m in ("forward", "train")
    ]
    assert {gate.full_length(c) for c in cells} == {128}  # every row at 128, sampled at seq_len
    calls = compiled.KERNELS["block_sparse_plan"].calls
    before = compiled.stats()
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        cases = [protocol.run_case(c, 0, "benchmark") for c in cells]
    for case in cases:
        assert case.status == "ok", case.error
        assert case.result is not None
        assert case.result.backend == "flex-compiled-plan-cuda"
        assert case.result.sampled_check_seq_len == case.seq_len
    counts = [c.result.compilations for c in cases if c.result is not None]
    assert counts == [2, 2, 1, 1]
    made = compiled.stats().since(before)
    assert made.compilations == sum(counts) == 6
    seconds = [c.result.compile_s for c in cases if c.result is not None]
    assert all(s is not None and s > 0 for s in seconds)
    assert sum(s for s in seconds if s is not None) == pytest.approx(made.compile_s)
    assert compiled.KERNELS["block_sparse_plan"].calls > calls
    assert "recompile_limit" not in caplog.text


def test_past_the_limit_a_compiled_kernel_raises_naming_itself_and_the_shapes(
    eager_compile: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run fails with the kernel's name and the shape it met, instead of torch's fallback
    to the unfused kernel (which materializes the scores)."""
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 2)
    params = {"block_size": 8, "pattern": "local_window", "window": 1, "plan": "cuda"}
    base = {"kernel": "block_sparse", "params": params, "correctness_check": False}
    for n in (64, 128):
        assert protocol.run_case(config(**base, seq_len=n)).status == "ok"
    case = protocol.run_case(config(**base, seq_len=192))
    assert case.status == "failed" and case.error is not None
    assert "'block_sparse_plan' hit its recompile limit (2 shapes" in case.error
    assert "(1, 2, 192, 16) float32" in case.error and "does not run uncompiled" in case.error


def test_warmup_zero_still_primes_at_the_runs_length(eager_compile: None) -> None:
    """warmup 0 (the max_seq_len search's): the warm-up at the run's length compiles, so the
    first timed iteration (which also gives the peak) compiles nothing."""
    params = {"block_size": 8, "pattern": "local_window", "window": 1, "plan": "cuda"}
    cfg = config(kernel="block_sparse", params=params, seq_len=256, warmup=0, iterations=1)
    for mode, graphs in (("forward", 1), ("train", 1)):
        case = protocol.run_case(cfg.model_copy(update={"mode": mode, "correctness_check": False}))
        assert case.status == "ok", case.error
        assert case.result is not None and case.result.compilations == graphs


def test_a_compilation_inside_the_metered_iterations_fails_the_run(
    eager_compile: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the warm-up the first metered iteration would compile: the run says so rather
    than time the compiler."""
    monkeypatch.setattr(protocol, "_prime", lambda *args: None)
    params = {"block_size": 8, "pattern": "local_window", "window": 1, "plan": "cuda"}
    case = protocol.run_case(
        config(kernel="block_sparse", params=params, seq_len=128, correctness_check=False)
    )
    assert case.status == "failed" and case.error is not None
    assert "1 torch.compile compilation(s) ran inside the metered iterations" in case.error


def test_a_max_seq_len_search_compiles_each_probe_outside_its_measurement(
    eager_compile: None,
) -> None:
    """Each probe of a warmup-0 search is a new length, so a new graph: its warm-up at that
    length compiles it, its one metered iteration does not (the run would fail)."""
    params = {"block_size": 8, "pattern": "local_window", "window": 1, "plan": "cuda"}
    cfg = config(
        kernel="block_sparse",
        params=params,
        warmup=0,
        iterations=1,
        correctness_check=False,
        search={"start": 128, "max": 512, "granularity": 64},
    )
    seen: list[CaseOutcome] = []

    def run_probe(probe: RunConfig, first: bool) -> list[CaseOutcome]:
        seen.append(protocol.run_case(probe, 0, "max_seq_len"))
        return seen[-1:]

    outcome = run_search(cfg, run_probe)
    assert outcome.status == "succeeded" and outcome.answer_seq_len == 512
    assert [c.seq_len for c in seen] == [128, 256, 512]
    compiled_per_probe: list[Any] = [c.result.compilations for c in seen if c.result]
    assert compiled_per_probe == [1, 1, 1]
