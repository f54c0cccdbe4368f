"""`ringlab show` prints the spec as the researcher wrote it: the stored spec fills every unset
field (each kernel's params whole) with null, and those nulls are left out."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.cli.console import CliError
from service.cli.specs import load_specs, spec_yaml
from service.spec import SweepSpec

WRITTEN = {
    "name": "ring against ulysses",
    "base": {"seq_len": 1024, "world_size": 2, "causal": True, "device": "cpu"},
    "zip": {
        "kernel": ["ring", "ulysses", "ring"],
        "params": [{"layout": "zigzag"}, {"inner": "dense"}, {"layout": None}],
    },
}


def test_show_leaves_out_the_nulls_the_store_filled_in() -> None:
    stored = SweepSpec.model_validate(WRITTEN).model_dump(mode="json")
    assert "null" in yaml.safe_dump(stored)  # the stored spec does fill them in
    shown = spec_yaml(stored)
    assert "null" not in shown, shown
    back = yaml.safe_load(shown)
    assert back["name"] == WRITTEN["name"]
    assert back["zip"]["kernel"] == ["ring", "ulysses", "ring"]
    params = back["zip"]["params"]
    assert params == [{"layout": "zigzag"}, {"inner": "dense"}, {}]  # {} : layout's default
    assert {k: v for k, v in back["base"].items() if k in WRITTEN["base"]} == WRITTEN["base"]


def test_a_document_that_is_not_a_mapping_is_named_as_every_other_problem(tmp_path: Path) -> None:
    """documents[1], counted from 0 as the service's problem paths count them."""
    path = tmp_path / "two.yaml"
    path.write_text("name: a\nbase: {kernel: dense, seq_len: 64}\n---\n- not a spec\n")
    with pytest.raises(CliError) as caught:
        load_specs(str(path))
    assert str(caught.value) == f"{path}: documents[1] is not a mapping (name, kind, base, grid...)"
