"""A run-level `mask` in a sweep spec: every kind is stored in the one form the older spellings
(`causal`, `params.mask`) store, with the same cell key; a mask that contradicts params.mask,
params.document_lengths or an explicit `causal`, or that the kernel does not take, is a 422
at the path the user wrote, storing nothing; so is params.document_lengths (stored as the
documents params.mask) beside params.mask, or with a bad length."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from _api_helpers import api_client, as_search, refused

from service.cli.specs import load_specs
from service.spec import SpecError, SweepSpec, expand

API = "/api/v1"
SHAPE = {"num_heads": 2, "head_dim": 16, "warmup": 1, "iterations": 2}
DOCS = {"kind": "documents", "causal": True, "lengths": [768, 256]}
WINDOW = {"kind": "sliding_window", "causal": True, "window": 64}
PREFIX = {"kind": "prefix_lm", "prefix": 100}
SAMPLED = {
    "kind": "documents", "causal": True,
    "sampled": {"distribution": "lognormal", "mean": 128, "max_fraction": 0.25, "seed": 0},
}  # fmt: skip


def _cells(
    base: dict[str, Any], grid: dict[str, Any] | None = None, zipped: dict[str, Any] | None = None
) -> list[Any]:
    body = {"name": "m", "base": {**SHAPE, **base}, "grid": grid or {"seq_len": [1024, 2048]}}
    return expand(SweepSpec.model_validate({**body, "zip": zipped or {}}))


def _stored(cells: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.cell_key, c.config_json) for c in cells]


# (run-level spelling, the older spelling it stores as, causal stored, params.mask stored)
SPELLINGS = [
    ({"mask": {"kind": "full"}}, {}, False, None),
    ({"mask": {"kind": "causal"}}, {"causal": True}, True, None),
    ({"mask": {"kind": "causal"}, "causal": True}, {"causal": True}, True, None),
    ({"mask": DOCS}, {"causal": True, "params": {"mask": DOCS}}, True, DOCS),
    ({"mask": WINDOW}, {"causal": True, "params": {"mask": WINDOW}}, True, WINDOW),
    ({"mask": PREFIX}, {"params": {"mask": PREFIX}}, False, PREFIX),
]


@pytest.mark.parametrize(("run_level", "older", "causal", "mask"), SPELLINGS)
def test_a_run_level_mask_stores_what_the_older_spelling_stores(
    run_level: dict[str, Any], older: dict[str, Any], causal: bool, mask: dict[str, Any] | None
) -> None:
    kernels = {"kernel": ["dense", "ring"], "world_size": [1, 2]}
    got = _cells(run_level, {"seq_len": [1024]}, kernels)
    want = _cells(older, {"seq_len": [1024]}, kernels)
    assert len(got) == 2 and _stored(got) == _stored(want)
    for cell in got:
        assert "mask" not in cell.config_json  # no run-level field is stored
        assert cell.config_json["causal"] is causal
        assert cell.config_json["params"]["mask"] == mask


def test_mask_causal_and_causal_true_are_one_cell_key() -> None:
    [a] = _cells({"kernel": "sdpa", "mask": {"kind": "causal"}}, {"seq_len": [1024]})
    [b] = _cells({"kernel": "sdpa", "causal": True}, {"seq_len": [1024]})
    [c] = _cells({"kernel": "sdpa"}, {"seq_len": [1024]})
    assert a.cell_key == b.cell_key != c.cell_key
    assert a.config_json == b.config_json and a.config_json["causal"] is True


def test_a_sampled_run_level_mask_is_written_out_at_each_length() -> None:
    got = _cells({"kernel": "dense", "mask": SAMPLED})
    want = _cells({"kernel": "dense", "causal": True, "params": {"mask": SAMPLED}})
    assert _stored(got) == _stored(want)
    assert [sum(c.config_json["params"]["mask"]["lengths"]) for c in got] == [1024, 2048]


def test_a_mask_axis_through_the_memo_stores_each_cell_as_alone() -> None:
    """Cells the memo builds (a mask axis decides params and causal) equal cells built alone."""
    masks = [{"kind": "full"}, {"kind": "causal"}, DOCS, WINDOW, PREFIX]
    grid = {"mask": masks, "seq_len": [1024], "batch_size": [1, 2, 3], "num_heads": [2, 4]}
    cells = _cells({"kernel": "dense"}, grid)
    assert len(cells) == 30
    assert sum(c.built_over is not None for c in cells) > 0  # the memo built some
    for cell in cells:
        alone = _cells({"kernel": "dense", **cell.axes}, {"seq_len": [1024]})
        assert _stored([cell]) == _stored(alone), cell.axes


def test_the_documents_study_with_its_mask_at_run_level_expands_the_same() -> None:
    [study] = load_specs("cpu-documents.yaml")
    moved = copy.deepcopy(study)
    moved["base"]["mask"] = moved["base"].pop("params")["mask"]
    del moved["base"]["causal"]
    want = expand(SweepSpec.model_validate(study))
    assert _stored(expand(SweepSpec.model_validate(moved))) == _stored(want)
    assert len(want) == 26


def _sweep(base: dict[str, Any], grid: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": "masks", "base": {**SHAPE, **base}, "grid": grid or {"seq_len": [1024]}}


REFUSED = [
    (
        {"kernel": "dense", "mask": DOCS, "params": {"mask": DOCS}},
        None,
        ["base", "mask"],
        "give the mask here or as params.mask, not both",
    ),
    (
        {"kernel": "dense", "mask": DOCS, "params": {"document_lengths": [768, 256]}},
        None,
        ["base", "mask"],
        "give the mask here or as params.document_lengths, not both",
    ),
    (
        {"kernel": "dense", "mask": DOCS, "causal": False},
        None,
        ["base", "causal"],
        "the mask documents is causal; leave causal out or set it to true",
    ),
    (
        {"kernel": "dense", "mask": {"kind": "full"}},
        {"seq_len": [1024], "causal": [False, True]},
        ["grid", "causal", 1],
        "the mask full is not causal; leave causal out or set it to false",
    ),
    (
        {"kernel": "sdpa", "mask": WINDOW},
        None,
        ["base", "mask"],
        "kernel 'sdpa' takes the masks causal, full, not sliding_window",
    ),
    (
        {"kernel": "ring", "world_size": 2, "mask": {**DOCS, "lengths": [1001, 23]}}
        | {"params": {"balance": "per_document"}},
        None,
        ["base", "mask", "lengths"],
        "balance per_document needs every document to",
    ),
    (
        {"kernel": "dense", "mask": {**DOCS, "lengths": [1000, 23]}},
        None,
        ["base", "mask", "lengths"],
        "the documents' lengths sum to 1023, but seq_len is 1024",
    ),
    (
        {"kernel": "dense"},
        {"seq_len": [1024], "mask": [{"kind": "causal"}, {**WINDOW, "window": 0}]},
        ["grid", "mask", 1, "window"],
        "expected an integer >= 1, got 0",
    ),
    (
        {"kernel": "dense", "mask": {"kind": "causal", "window": 4}},
        None,
        ["base", "mask", "window"],
        "unknown field for kind causal",
    ),
    # params.document_lengths is stored as params.mask (tests/service/test_document_lengths_mask)
    (
        {"kernel": "ring", "world_size": 2, "mask": DOCS},
        {"seq_len": [1024], "params.document_lengths": [[768, 256]]},
        ["base", "mask"],
        "give the mask here or as params.document_lengths, not both",
    ),
    (
        {"kernel": "dense", "causal": True, "params": {"mask": DOCS, "document_lengths": [1024]}},
        None,
        ["base", "params", "document_lengths"],
        "give the documents in `mask`",
    ),
    (
        {"kernel": "ring", "world_size": 2, "causal": True, "params": {"mask": DOCS}},
        {"seq_len": [1024], "params.document_lengths": [[768, 256]]},
        ["grid", "params.document_lengths", 0],
        "give the documents in `mask`",
    ),
    (
        {"kernel": "dense", "causal": True, "params": {"document_lengths": [768, 255]}},
        None,
        ["base", "params", "document_lengths"],
        "the documents' lengths sum to 1023, but seq_len is 1024",
    ),
    (
        {"kernel": "ulysses", "world_size": 2, "params": {"inner": "dilated"}},
        {"seq_len": [1024], "params.document_lengths": [[768, 256]]},
        ["grid", "params.document_lengths", 0],
        "which takes the masks causal, full, not documents",
    ),
]


@pytest.mark.parametrize(("base", "grid", "loc", "says"), REFUSED)
def test_a_contradicting_or_untaken_run_level_mask_is_a_422_at_its_path(
    database_url: str, base: dict[str, Any], grid: dict[str, Any] | None, loc: list, says: str
) -> None:
    with api_client(database_url) as client:
        problem = refused(client, _sweep(base, grid))
        assert problem["loc"] == ["body", *loc]
        assert says in problem["msg"]
        assert client.get(f"{API}/runs").json()["count"] == 0


def test_a_run_level_mask_is_stored_as_params_mask_through_the_api(database_url: str) -> None:
    spec = _sweep({"kernel": "dense"}, {"seq_len": [1024], "mask": [{"kind": "causal"}, DOCS]})
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=spec)
        assert r.status_code == 201, r.text
        runs = client.get(f"{API}/runs").json()["data"]
    stored = [(run["config"]["causal"], run["config"]["params"]["mask"]) for run in runs]
    assert sorted(stored, key=repr) == sorted([(True, None), (True, DOCS)], key=repr)
    assert all("mask" not in run["config"] for run in runs)


def test_a_search_refuses_a_run_level_documents_mask_at_mask(database_url: str) -> None:
    spec = as_search(_sweep({"kernel": "ring", "world_size": 2, "mask": SAMPLED}))
    with api_client(database_url) as client:
        problem = refused(client, spec)
        assert problem["loc"] == ["body", "base", "mask"]
        assert "fix the sequence length" in problem["msg"]
        spec["base"]["mask"] = WINDOW  # any length: searched
        assert client.post(f"{API}/sweeps", json=spec).status_code == 201
        [run] = client.get(f"{API}/runs").json()["data"]
    assert run["config"]["causal"] is True and run["config"]["params"]["mask"] == WINDOW


def test_a_causal_only_the_mask_set_is_refused_at_mask() -> None:
    """A model cell trains causally: a full run-level mask is refused where it was written."""
    model = {"d_model": 64, "n_layers": 1, "n_heads": 2, "vocab_size": 128}
    base = {"workload": "model", "kernel": "dense", "model": model, "training": {}}
    body = {"name": "m", "base": {**base, "mask": {"kind": "full"}}, "grid": {"seq_len": [64]}}
    with pytest.raises(SpecError) as refused:
        expand(SweepSpec.model_validate(body))
    [error] = refused.value.errors
    assert error["loc"] == ["base", "mask"]
    assert "a model cell's causal is True" in error["msg"]
    body["base"]["mask"] = {"kind": "causal"}
    [cell] = expand(SweepSpec.model_validate(body))
    [alone] = expand(SweepSpec.model_validate({**body, "base": base}))
    assert cell.cell_key == alone.cell_key
