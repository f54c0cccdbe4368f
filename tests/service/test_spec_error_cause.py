"""A value that breaks many cells is one error at that value: `world_size: 3` beside several
seq_len values says once which lengths it breaks and in how many cells, not once per length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _api_helpers import api_client

from service.spec import SpecError, SweepSpec, expand

BASE = {"kernel": "ring", "num_heads": 4, "head_dim": 16, "device": "cpu"}


def _errors(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    with pytest.raises(SpecError) as caught:
        expand(SweepSpec.model_validate({"name": "w", "base": BASE, "grid": grid}))
    return caught.value.errors


def test_world_size_3_is_one_error_naming_the_lengths_it_breaks() -> None:
    errors = _errors({"seq_len": [1024, 2048, 4096], "world_size": [1, 2, 3]})
    assert errors == [
        {
            "loc": ["grid", "world_size", 2],
            "msg": (
                "seq_len must be divisible by world_size 3 in 3 cells (seq_len=1024, 2048, 4096)"
            ),
            "type": "value_error",
        }
    ]


def test_the_count_is_of_cells_and_a_long_list_is_cut() -> None:
    # 3072 and 6144 divide by 3: six lengths broken, each in two batch sizes
    lengths = [1024 * i for i in range(1, 9)]
    errors = _errors({"seq_len": lengths, "world_size": [1, 3], "batch_size": [1, 2]})
    assert [e["loc"] for e in errors] == [["grid", "world_size", 1]]
    assert errors[0]["msg"] == (
        "seq_len must be divisible by world_size 3 in 12 cells "
        "(seq_len=1024, 2048, 4096, 5120, 7168, ... 1 more)"
    )


def test_one_broken_length_stays_at_the_length() -> None:
    """Only 1024 breaks with either world size: the length, not a world size, is the mistake
    to name (one error per world size, each at the length, naming its cell)."""
    errors = _errors({"seq_len": [1024, 3072], "world_size": [3]})
    assert errors == [
        {
            "loc": ["grid", "seq_len", 0],
            "msg": "1024 must be divisible by world_size 3 (cell seq_len=1024, world_size=3)",
            "type": "value_error",
        }
    ]


def test_world_size_32_is_not_world_size_3() -> None:
    errors = _errors({"seq_len": [1000, 2000], "world_size": [3, 32]})
    assert sorted(tuple(e["loc"]) for e in errors) == [
        ("grid", "world_size", 0),
        ("grid", "world_size", 1),
    ]
    assert [e["msg"].split(" in ")[0] for e in errors] == [
        "seq_len must be divisible by world_size 3",
        "seq_len must be divisible by world_size 32",
    ]


def test_the_api_answers_one_422_line_at_the_value(tmp_path: Path) -> None:
    body = {"name": "w", "base": BASE, "grid": {"seq_len": [1024, 2048], "world_size": [3]}}
    with api_client(f"sqlite:///{tmp_path / 's.db'}") as client:
        r = client.post("/api/v1/sweeps", json=body)
    assert r.status_code == 422
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "grid", "world_size", 0]
    assert (
        error["msg"] == "seq_len must be divisible by world_size 3 in 2 cells (seq_len=1024, 2048)"
    )
