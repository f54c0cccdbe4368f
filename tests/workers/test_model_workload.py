"""The `workload: model` cell end to end on CPU: a real training run through the protocol, the
config's refusals (directly and through the sweep spec), sequence parallelism over a ring of
gloo processes against the dense model, and a max-length search that starts from the
prediction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dist_helpers import run_ranks, single_thread
from _workers_helpers import planted_result
from pydantic import ValidationError

from service.spec import SpecError, SweepSpec, expand
from workers import kernels, model_memory, protocol, search, training
from workers.config import RunConfig
from workers.search import predicted_start, run_search, snap_down

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 2048}


def model_cell(**fields: Any) -> dict[str, Any]:
    """The raw fields of a small CPU model cell (dense, 1024 tokens) with `fields` on top."""
    return {
        "workload": "model",
        "kernel": "dense",
        "seq_len": 1024,
        "device": "cpu",
        "warmup": 1,
        "iterations": 2,
        "model": TINY,
        **fields,
    }


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while a test trains (single_thread)."""
    with single_thread():
        yield


# --- a run ------------------------------------------------------------------------------------


def test_model_case_measures_every_component_beside_its_prediction(one_thread: None) -> None:
    config = RunConfig.model_validate(model_cell())
    # filled in from the model and training: 4 heads of 16, fp32, train, causal
    assert (config.num_heads, config.head_dim, config.dtype) == (4, 16, "float32")
    assert config.mode == "train" and config.causal
    case = protocol.run_case(config)
    assert case.status == "ok" and case.error is None
    result = case.result
    components = {c.component: c for c in result.components}
    assert set(components) == {*model_memory.COMPONENTS, "optimizer_state_tensors"}
    predicted = model_memory.predict(config)
    for name, value in predicted.components().items():
        assert components[name].predicted_bytes == value, name
    # the optimizer's state tensors are exactly what was predicted
    tensors = components["optimizer_state_tensors"]
    assert tensors.measured_bytes == tensors.predicted_bytes == predicted.optimizer_states
    # the CPU allocator's bytes (workers.memory.PeakMeter), as on CUDA: parameters, gradients
    # and states exactly, the phases within 0.1% (a few scalars: 8-16 B here). The resident-set
    # meter read them 0.996-1.052 of the prediction, activations within 15% was its bound.
    for name in ("parameters", "gradients", "optimizer_states"):
        assert components[name].measured_bytes == components[name].predicted_bytes, name
    for name in ("activations", "forward_transient", "backward_peak", "step_peak"):
        got, want = components[name].measured_bytes, components[name].predicted_bytes
        assert got == pytest.approx(want, rel=1e-3), (name, got, want)
    assert components["allocator_overhead"].measured_bytes is None  # CUDA only
    assert result.device_used_bytes is None  # CUDA only: absent on CPU, not 0
    # times: phases, median, throughput and FLOPs agree with each other
    assert len(result.times_s) == 2 and all(t > 0 for t in result.times_s)
    phases = result.forward_s + result.backward_s + result.optimizer_s
    assert phases == pytest.approx(result.median_s, rel=0.2)
    assert result.forward_s > 0 and result.backward_s > 0 and result.optimizer_s > 0
    assert result.tokens_per_s == pytest.approx(1024 / result.median_s)
    assert result.flops == training.model_flops(config)
    assert result.flops_per_s == pytest.approx(result.flops / result.median_s)
    n_params = predicted.parameters // 4
    assert result.flops > 6 * n_params * 1024  # plus the attention of both blocks
    assert result.peak_memory_bytes >= components["activations"].measured_bytes
    assert result.backend == "sdpa-flash-cpu"


# --- refusals ---------------------------------------------------------------------------------


def _refusal(raw: dict[str, Any]) -> str:
    """The one error message validating `raw` gives."""
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(raw)
    errors = info.value.errors()
    assert len(errors) == 1, errors
    return str(errors[0]["msg"]).removeprefix("Value error, ")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_adamw8bit_off_cuda_names_the_optimizer(device: str) -> None:
    msg = _refusal(model_cell(device=device, training={"optimizer": "adamw8bit"}))
    assert msg.startswith("training.optimizer: adamw8bit") and "CUDA" in msg and device in msg


def test_model_cell_refuses_what_contradicts_its_model() -> None:
    msg = _refusal(model_cell(num_heads=8))
    assert msg.startswith("num_heads: ") and "4" in msg and "8" in msg
    msg = _refusal(model_cell(head_dim=32))
    assert msg.startswith("head_dim: ") and "16" in msg
    msg = _refusal(model_cell(training={"precision": "bf16"}, dtype="float32"))
    assert msg.startswith("dtype: ") and "bfloat16" in msg
    msg = _refusal(model_cell(causal=False))
    assert msg.startswith("causal: ")
    # what agrees is accepted: bf16 training computes attention in bfloat16
    config = RunConfig.model_validate(model_cell(training={"precision": "bf16"}, num_heads=4))
    assert config.dtype == "bfloat16"


def test_attention_cell_refuses_model_and_training() -> None:
    base = {"kernel": "dense", "seq_len": 256, "device": "cpu"}
    msg = _refusal({**base, "model": TINY})
    assert msg.startswith("model: ") and "workload: model" in msg
    msg = _refusal({**base, "training": {"optimizer": "sgd"}})
    assert msg.startswith("training: ")
    assert RunConfig.model_validate(base).model is None


def test_model_cell_needs_a_model() -> None:
    raw = model_cell()
    del raw["model"]
    assert _refusal(raw).startswith("model: ")


def test_layer_kernel_in_a_model_cell_names_the_kernel() -> None:
    msg = _refusal(model_cell(kernel="multihead"))
    assert msg.startswith("kernel: multihead") and "own projections" in msg


def test_training_and_model_shape_refusals_name_their_field() -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(model_cell(training={"checkpoint_every": 2}))
    (error,) = info.value.errors()
    assert error["loc"] == ("training",)
    assert error["msg"].removeprefix("Value error, ").startswith("checkpoint_every: only for")

    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(model_cell(training={"checkpointing": "every_k"}))
    (error,) = info.value.errors()
    assert "checkpoint_every: checkpointing every_k needs" in error["msg"]

    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(model_cell(model={**TINY, "num_kv_heads": 3}))
    (error,) = info.value.errors()
    assert error["loc"] == ("model",)
    assert error["msg"].removeprefix("Value error, ").startswith("num_kv_heads: 3 must divide")

    accepted = RunConfig.model_validate(model_cell(model={**TINY, "num_kv_heads": 2}))
    assert accepted.model.kv_heads == 2 and accepted.num_heads == 4


def _spec_errors(**spec: Any) -> list[dict[str, Any]]:
    with pytest.raises(SpecError) as info:
        expand(SweepSpec.model_validate({"name": "model sweep", **spec}))
    return info.value.errors


def test_spec_errors_name_the_nested_path() -> None:
    base = model_cell()
    errors = _spec_errors(base=base, grid={"training.optimizer": ["adamw", "adamw8bit"]})
    assert [e["loc"] for e in errors] == [["grid", "training.optimizer", 1]]
    assert "adamw8bit" in errors[0]["msg"] and "CUDA" in errors[0]["msg"]

    errors = _spec_errors(base={**base, "model": {"n_layers": 2, "n_heads": 4}})
    assert ["base", "model", "d_model"] in [e["loc"] for e in errors]

    errors = _spec_errors(base=base, grid={"model.num_kv_heads": [2, 3]})
    assert [e["loc"] for e in errors] == [["grid", "model.num_kv_heads", 1]]
    assert "must divide n_heads" in errors[0]["msg"]

    errors = _spec_errors(base=base, grid={"model.widths": [1]})
    assert errors[0]["loc"] == ["grid", "model.widths"] and "d_model" in errors[0]["msg"]


def test_spec_expands_nested_axes_into_cells() -> None:
    spec = SweepSpec.model_validate(
        {
            "name": "model sweep",
            "base": model_cell(),
            "grid": {"model.d_model": [64, 128], "training.precision": ["fp32", "bf16"]},
        }
    )
    cells = expand(spec)
    got = {
        (c.config.model.d_model, c.config.training.precision): (c.config.head_dim, c.config.dtype)
        for c in cells
    }
    assert got == {
        (64, "fp32"): (16, "float32"),
        (64, "bf16"): (16, "bfloat16"),
        (128, "fp32"): (32, "float32"),
        (128, "bf16"): (32, "bfloat16"),
    }
    assert all(c.config.model.n_layers == 2 and c.config.model.vocab_size == 2048 for c in cells)
    assert all(c.config_json["model"]["d_model"] == c.axes["model.d_model"] for c in cells)
    assert len({c.cell_key for c in cells}) == 4


# --- sequence parallel --------------------------------------------------------------------------

SP_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "num_kv_heads": 2, "vocab_size": 97}
SP_SEQ = 64


def _sp_config(kernel: str, world: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "workload": "model",
            "kernel": kernel,
            "seq_len": SP_SEQ,
            "world_size": world,
            "device": "cpu",
            "seed": 7,
            "model": SP_MODEL,
        }
    )


def _loss_and_grads(trainer: training._Trainer) -> dict[str, Any]:
    loss = trainer.forward()
    trainer.backward(loss)  # all-reduces the gradients when world > 1
    return {
        "loss": loss.detach(),
        "positions": trainer.positions.clone(),
        "grads": {n: p.grad.clone() for n, p in trainer.net.named_parameters()},
        "weights": {n: p.detach().clone() for n, p in trainer.net.named_parameters()},
    }


def ring_rank(rank: int, world: int) -> dict[str, Any]:
    """One rank of the ring model: its loss share, positions, reduced gradients, weights."""
    return _loss_and_grads(training._Trainer(_sp_config("ring", world), rank, CPU))


def test_ring_sequence_parallel_model_equals_the_dense_model() -> None:
    """Two gloo ranks, each holding half of the sequence in the ring's causal (zigzag) order:
    the losses add up to the dense model's and the all-reduced gradients are its gradients,
    which only holds if rotary uses each token's global position."""
    ranks = run_ranks(ring_rank, 2)
    ref = _loss_and_grads(training._Trainer(_sp_config("dense", 1), 0, CPU))
    # zigzag: each rank holds a chunk from the front and its mirror from the back
    pos0, pos1 = (r["positions"] for r in ranks)
    assert pos0.tolist() == [*range(16), *range(48, 64)]
    assert pos1.tolist() == list(range(16, 48))
    assert torch.equal(ref["positions"], torch.arange(SP_SEQ))
    for r in ranks:  # the same seeded weights everywhere
        for name, w in ref["weights"].items():
            assert torch.equal(r["weights"][name], w), name
    total = ranks[0]["loss"] + ranks[1]["loss"]
    torch.testing.assert_close(total, ref["loss"], atol=1e-5, rtol=1e-5)
    assert ranks[0]["loss"] > 0 and ranks[1]["loss"] > 0
    for name, grad in ref["grads"].items():
        assert grad.abs().max() > 0, name
        for r in ranks:
            torch.testing.assert_close(
                r["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )


# --- search -------------------------------------------------------------------------------------


def _doubling_probes(limit: int, start: int, granularity: int) -> int:
    """Probes a doubling search from `start` needs when lengths up to `limit` fit (no kernel
    constraints: dense)."""
    config = RunConfig.model_validate(
        {"kernel": "dense", "seq_len": start, "device": "cpu"}
        | {"search": {"start": start, "max": 1 << 20, "granularity": granularity}}
    )
    log: list[int] = []

    def run_probe(cfg: RunConfig, first: bool) -> list[Any]:
        from workers.results import CaseOutcome

        log.append(cfg.seq_len)
        if cfg.seq_len > limit:
            return [CaseOutcome(rank=0, seq_len=cfg.seq_len, status="oom", emulated=True)]
        result = planted_result(cfg.seq_len, 1.0, 1)
        return [CaseOutcome(rank=0, seq_len=cfg.seq_len, status="ok", result=result)]

    outcome = run_search(config, run_probe)
    assert outcome.answer_seq_len is not None and outcome.answer_seq_len <= limit
    return len(log)


def _search_alone(config_json: dict[str, Any]) -> dict[str, Any]:
    """A model search measured in a process of its own (one intra-op thread), as a rank runs
    one: the CPU meter is a profiler session, one of which a process runs at a time."""
    torch.set_num_threads(1)
    config = RunConfig.model_validate(config_json)
    lengths: list[int] = []

    def run_probe(cfg: RunConfig, first: bool) -> list[Any]:
        lengths.append(cfg.seq_len)
        return [protocol.run_case(cfg)]

    outcome = run_search(config, run_probe)
    return {
        "status": outcome.status,
        "lengths": lengths,
        "answer": outcome.answer_seq_len,
        "probes": [(p.seq_len, p.outcome, p.peak_memory_bytes) for p in outcome.probes],
        "rank_seq_len": outcome.ranks[0].seq_len if outcome.ranks else None,
        "predicted": outcome.ranks[0].predicted_max_seq_len if outcome.ranks else None,
    }


def test_model_search_starts_from_the_predicted_maximum() -> None:
    import multiprocessing

    budget = 64 << 20
    config = RunConfig.model_validate(
        model_cell(
            warmup=0,
            iterations=1,
            memory_budget_bytes=budget,
            search={"start": 1024, "max": 1 << 20, "granularity": 64},
        )
    )
    start = predicted_start(config)
    assert start == model_memory.max_seq_len(config, budget)
    assert start is not None and start > 1024
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        found = pool.apply(_search_alone, (config.model_dump(mode="json"),))
    assert found["status"] == "succeeded"
    assert found["lengths"][0] == snap_down(config, start)
    answer = found["answer"]
    assert answer == pytest.approx(start, rel=0.1)
    # every probe at or below the answer fit within the budget; the ones above did not
    for seq_len, outcome, peak in found["probes"]:
        assert (outcome == "fit") == (seq_len <= answer), (seq_len, outcome)
        if outcome == "fit":
            assert peak <= budget
    assert found["rank_seq_len"] == answer
    assert found["predicted"] == model_memory.max_seq_len(config, budget)
    # far fewer probes than doubling from search.start to the same answer would take
    assert len(found["probes"]) <= 5
    assert len(found["probes"]) < _doubling_probes(answer, 1024, 64)
    assert search.BRACKET_FACTOR < 2


def test_attention_cell_or_no_budget_has_no_predicted_start() -> None:
    no_budget = RunConfig.model_validate(model_cell())
    assert predicted_start(no_budget) is None
    attention_cell = RunConfig.model_validate(
        {"kernel": "dense", "seq_len": 1024, "device": "cpu", "memory_budget_bytes": 1 << 30}
    )
    assert predicted_start(attention_cell) is None
    ring = RunConfig.model_validate(model_cell(kernel="ring", memory_budget_bytes=1 << 30))
    assert kernels.is_distributed(ring.kernel) and predicted_start(ring) is None  # no model


def test_expansion_leaves_the_spec_alone_and_refuses_a_field_set_twice() -> None:
    """A whole-model axis and a model.<name> axis: the submitted objects are not changed by
    expanding, and a field both set is refused (one of them would win silently)."""
    from service.spec import SpecError, SweepSpec, expand

    base = {"workload": "model", "kernel": "dense", "seq_len": 64, "device": "cpu"}
    models = [{"d_model": 64, "n_heads": 4}]
    spec = SweepSpec(name="m", base=base, grid={"model": models, "model.n_layers": [1, 2]})
    assert len(expand(spec)) == 2
    assert spec.grid["model"] == [{"d_model": 64, "n_heads": 4}]
    twice = SweepSpec(name="m", base=base, grid={"model": models, "model.d_model": [128]})
    with pytest.raises(SpecError) as refused:
        expand(twice)
    (error,) = refused.value.errors
    assert error["loc"] == ["grid", "model.d_model"]
    assert "d_model is also set by the model axis's objects" in error["msg"]


def test_an_odd_head_size_is_refused_at_the_model() -> None:
    with pytest.raises(ValueError, match="head_dim = d_model / n_heads = 3 must be even"):
        RunConfig.model_validate(
            {"workload": "model", "kernel": "dense", "seq_len": 16,
             "model": {"d_model": 24, "n_heads": 8, "n_layers": 1}}
        )  # fmt: skip
