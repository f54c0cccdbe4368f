"""A run's `mask` and `balance` through the API: a sampled mask is stored written out as its
lengths at each cell's seq_len (so the stored config says what ran), and a mask or balance a
kernel does not take is a 422 at params.mask / params.balance naming the kernel, storing
nothing."""

from __future__ import annotations

from typing import Any

import pytest
from _api_helpers import api_client, as_search, refused

from attention.errors import ParamError
from attention.mask import expand
from workers import resolved
from workers.config import RunConfig

API = "/api/v1"
SAMPLED = {
    "distribution": "lognormal", "mean": 128, "max_fraction": 0.25, "seed": 0, "multiple_of": 4
}  # fmt: skip
DOCS = {"kind": "documents", "causal": True, "sampled": SAMPLED}
HALVES = {"kind": "documents", "causal": True, "lengths": [512, 512]}


def _sweep(kernel: str, params: dict[str, Any], grid: dict[str, Any] | None = None) -> dict:
    base = {
        "kernel": kernel, "params": params, "num_heads": 2, "head_dim": 16, "world_size": 2,
        "causal": True, "warmup": 1, "iterations": 2,
    }  # fmt: skip
    return {"name": "masks", "base": base, "grid": grid or {"seq_len": [1024]}}


def _stored(client: Any) -> tuple[int, int]:
    return client.get(f"{API}/sweeps").json()["count"], client.get(f"{API}/runs").json()["count"]


def test_expanded_masks_write_out_sampled_lengths_under_params() -> None:
    params = {"mask": DOCS, "balance": "ptrr"}
    got = resolved.expanded_masks(params, 2048)
    assert got == {"mask": expand(DOCS, 2048), "balance": "ptrr"}
    assert sum(got["mask"]["lengths"]) == 2048 and got["mask"]["sampled"] == SAMPLED
    assert resolved.expanded_masks(got, 2048) is got  # written out once
    assert resolved.mask_as_given(got["mask"]) == DOCS  # labels show what was asked for
    layer = resolved.expanded_masks({"kernel_params": {"mask": DOCS}}, 1024)
    assert layer["kernel_params"]["mask"] == expand(DOCS, 1024)
    with pytest.raises(ParamError) as bad:
        resolved.expanded_masks({"mask": {**DOCS, "sampled": {**SAMPLED, "seed": "x"}}}, 1024)
    assert bad.value.path == ("params", "mask", "sampled", "seed")


def test_a_sampled_mask_is_stored_as_its_lengths_at_each_cells_length(database_url: str) -> None:
    spec = _sweep(
        "ring",
        {"mask": DOCS, "balance": "per_document"},
        {"seq_len": [1024, 2048], "kernel": ["ring", "allgather_kv"]},
    )
    with api_client(database_url) as client:
        r = client.post(f"{API}/sweeps", json=spec)
        assert r.status_code == 201, r.text
        runs = client.get(f"{API}/runs").json()["data"]
    assert len(runs) == 4
    for run in runs:
        RunConfig.model_validate(run["config"])  # as the worker reads it back
        assert run["config"]["params"]["layout"] is None  # the balance sets the order
        mask = run["config"]["params"]["mask"]
        assert mask == expand(DOCS, run["seq_len"]), run["kernel"]
        assert sum(mask["lengths"]) == run["seq_len"]
        assert max(mask["lengths"]) <= 0.25 * run["seq_len"]


REFUSED = [
    (
        "ulysses",
        {"mask": {"kind": "causal"}, "balance": "ptrr"},
        ["params", "balance"],
        "kernel 'ulysses' takes no balance",
    ),
    (
        "ulysses",
        {
            "inner": "dilated",
            "segment_lengths": [64],
            "dilation_rates": [1],
            "mask": {"kind": "documents", "causal": True, "lengths": [1000, 24]},
        },
        ["params", "mask"],
        "inner kernel 'dilated', which takes the masks causal, full, not documents",
    ),
    ("dense", {"balance": "ptrr"}, ["params", "balance"], "unknown parameter of kernel 'dense'"),
    (
        "dilated",
        {"segment_lengths": [64], "dilation_rates": [1], "mask": {"kind": "causal"}},
        ["params", "mask"],
        "unknown parameter of kernel 'dilated'",
    ),
    (
        "ring",
        {"balance": "diagonal"},
        ["params", "balance"],
        "kernel 'ring' takes the balances head_tail, none, per_document, ptrr, not 'diagonal'",
    ),
    (
        "ring",
        {"mask": {"kind": "documents", "causal": True, "lengths": [1001, 23]}, "balance": "ptrr"}
        | {"balance": "per_document"},
        ["params", "mask", "lengths"],
        "balance per_document needs every document to",
    ),
    (
        "ring",
        {"mask": {**DOCS, "sampled": {**SAMPLED, "max_fraction": 2}}},
        ["params", "mask", "sampled", "max_fraction"],
        "must be in (0, 1]",
    ),
]


@pytest.mark.parametrize(("kernel", "params", "loc", "says"), REFUSED)
def test_a_mask_or_balance_the_kernel_does_not_take_is_a_422_storing_nothing(
    database_url: str, kernel: str, params: dict[str, Any], loc: list[str], says: str
) -> None:
    with api_client(database_url) as client:
        problem = refused(client, _sweep(kernel, params))
        assert problem["loc"] == ["body", "base", *loc]
        assert says in problem["msg"]
        assert _stored(client) == (0, 0)


@pytest.mark.parametrize("mask", [DOCS, HALVES])
def test_a_search_refuses_documents_that_fix_the_length(
    database_url: str, mask: dict[str, Any]
) -> None:
    spec = as_search(_sweep("ring", {"mask": mask}))
    with api_client(database_url) as client:
        problem = refused(client, spec)
        assert problem["loc"] == ["body", "base", "params", "mask"]
        assert "fix the sequence length" in problem["msg"]
        assert _stored(client) == (0, 0)
        spec["base"]["params"] = {"mask": {"kind": "causal"}}  # any length: searched
        assert client.post(f"{API}/sweeps", json=spec).status_code == 201
