"""A sweep's expansion checks every distinct part once, not every cell (service.spec_cells),
and gives exactly the cells a cell-by-cell validation gives; hostile values are still refused
in whichever cell holds them."""

from __future__ import annotations

from typing import Any

import pytest

import attention
from service import spec_expand
from service.cli.specs import bundled_examples, load_specs
from service.spec import SpecError, SweepSpec, expand
from service.spec_expand import _Expander


def _full(spec: SweepSpec, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The cells validated one by one, every cell in full (no memo)."""
    with monkeypatch.context() as m:
        m.setattr(_Expander, "memo", lambda self: None)
        return expand(spec)


def _same(spec: SweepSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    memo = expand(spec)
    full = _full(spec, monkeypatch)
    assert [c.cell_key for c in memo] == [c.cell_key for c in full]
    assert [c.config_json for c in memo] == [c.config_json for c in full]
    assert [c.axes for c in memo] == [c.axes for c in full]
    assert [c.config for c in memo] == [c.config for c in full]


MIXED = {
    "name": "mixed",
    "base": {"num_heads": 4, "head_dim": 16, "device": "cpu", "env": {"NCCL_DEBUG": "WARN"}},
    "grid": {
        "seq_len": [256, 512, 1024],
        "batch_size": [2, 4],
        "causal": [False, True],
        "iterations": ["auto", 3],
    },
    "zip": {
        "kernel": ["ring", "ulysses", "ring"],
        "world_size": [2, 2, 1],
        "params": [{"layout": "zigzag"}, {"inner": "dense"}, {}],
    },
}


def test_the_memo_gives_the_cells_a_full_validation_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _same(SweepSpec.model_validate(MIXED), monkeypatch)
    correctness = {**MIXED, "name": "c", "kind": "correctness"}
    _same(SweepSpec.model_validate(correctness), monkeypatch)
    for name in bundled_examples():
        for doc in load_specs(name):
            spec = SweepSpec.model_validate(doc)
            try:
                _full(spec, monkeypatch)
            except SpecError:  # a kernel or package missing here: both refuse it alike
                with pytest.raises(SpecError):
                    expand(spec)
                continue
            _same(spec, monkeypatch)


def test_each_distinct_part_is_validated_once_not_each_cell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = SweepSpec.model_validate(
        {
            "name": "big",
            "base": {"num_heads": 4, "head_dim": 16, "world_size": 2, "device": "cpu"},
            "grid": {"seq_len": [256 * (i + 1) for i in range(20)], "batch_size": [*range(1, 51)]},
            "zip": {"kernel": ["ring", "ulysses"], "params": [{"layout": "zigzag"}, {}]},
        }
    )
    calls: dict[str, int] = {"params": 0, "cells": 0, "kernel": 0}

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    normalize = counted("params", spec_expand.normalize_params)
    monkeypatch.setattr(spec_expand, "normalize_params", normalize)
    monkeypatch.setattr(_Expander, "validate", counted("cells", _Expander.validate))
    monkeypatch.setattr(attention, "validate", counted("kernel", attention.validate))
    cells = expand(spec)
    assert len(cells) == 20 * 50 * 2
    assert calls["params"] == 2  # once per distinct params object
    # a full validation per new length, batch size or kernel, and per (length, kernel) the
    # kernel's own check reads: 20 x 2 + 49 more batch sizes, out of 2,000 cells
    assert calls["cells"] == 20 * 2 + 49
    # the kernel's check runs only in those, and once more for each new (length, kernel) to
    # see what it reads
    assert calls["kernel"] == calls["cells"] + 20 * 2


@pytest.mark.parametrize(
    ("axis", "bad", "loc", "message"),
    [
        ("seq_len", 2**40, ["grid", "seq_len", 7], "must be <= "),
        ("batch_size", 10**6, ["grid", "batch_size", 7], "RINGLAB_MAX_BATCH_SIZE"),
        ("batch_size", 3, ["grid", "batch_size", 7], "must be divisible"),
        ("env", {"NCCL_X": "a\nb"}, ["grid", "env", 7], "no NUL, CR or LF"),
        ("params", {"layout": "spiral"}, ["grid", "params", 7, "layout"], "layout"),
        ("timeout_s", float("inf"), ["grid", "timeout_s", 7], ""),
    ],
)
def test_a_hostile_value_in_a_late_cell_is_still_refused_there(
    axis: str, bad: Any, loc: list[Any], message: str
) -> None:
    """Seven good values first, so the memo holds everything else of the cell."""
    good = {
        "seq_len": [256 * (i + 1) for i in range(7)],
        "batch_size": [2 * (i + 1) for i in range(7)],
        "env": [{"NCCL_DEBUG": f"V{i}"} for i in range(7)],
        "params": [{"layout": layout} for layout in ("zigzag", "striped", "contiguous")],
        "timeout_s": [60.0 + i for i in range(7)],
    }[axis]
    other = "seq_len" if axis != "seq_len" else "batch_size"
    base: dict[str, Any] = {"num_heads": 4, "head_dim": 16, "world_size": 2, "device": "cpu"}
    if axis == "params":
        base.update(kernel="ring", batch_size=2)
    else:
        base.update(kernel="dense", parallel="data", batch_size=2)
    spec = SweepSpec.model_validate(
        {
            "name": "hostile",
            "base": base,
            "grid": {other: [256, 512] if other == "seq_len" else [2, 4], axis: [*good, bad]},
        }
    )
    with pytest.raises(SpecError) as refused:
        expand(spec)
    errors = refused.value.errors
    assert [e["loc"] for e in errors] == [[len(good) if p == 7 else p for p in loc]], errors
    assert message in errors[0]["msg"]
