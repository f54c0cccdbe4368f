"""SweepSpec expansion: grid and zip axes, cell keys, and errors that point at the bad value."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from torch import nn

import attention
from attention.registry import KernelSpec
from service.spec import MAX_CELLS, SpecError, SweepSpec, cell_key, expand
from workers.config import RunConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass(frozen=True)
class BlockParams:
    """A test kernel's params: a block size that must be a power of two."""

    block_size: int = 64
    segments: tuple[int, ...] = (64,)

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"params.block_size: must be a power of two, got {self.block_size}")


def _check(
    params: BlockParams, *, seq_len: int, world_size: int, num_heads: int, causal: bool | None
) -> None:
    if (seq_len // world_size) % params.block_size:
        raise ValueError(
            f"seq_len: {seq_len} tokens on {world_size} ranks do not split into blocks of "
            f"{params.block_size}"
        )


@pytest.fixture
def blocked_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A distributed test kernel with a param and a divisibility rule, registered for one test."""
    spec = KernelSpec(
        name="_blocked_test",
        description="test kernel",
        params=BlockParams,
        factory=lambda _p: nn.Identity(),
        distributed=True,
        check=_check,
    )
    monkeypatch.setitem(attention.KERNELS, spec.name, spec)
    yield spec.name


def errors_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(SpecError) as info:
        expand(SweepSpec.model_validate(spec))
    return info.value.errors


def test_grid_is_cartesian_and_zip_varies_together() -> None:
    spec = SweepSpec(
        name="s",
        base={"kernel": "dense", "num_heads": 2, "parallel": "data"},
        grid={"seq_len": [128, 256, 512], "world_size": [1, 2]},
        zip={"batch_size": [2, 4], "head_dim": [16, 32]},
    )
    cells = expand(spec)
    assert len(cells) == 3 * 2 * 2
    pairs = {(c.config.batch_size, c.config.head_dim) for c in cells}
    assert pairs == {(2, 16), (4, 32)}
    combos = {(c.config.seq_len, c.config.world_size) for c in cells}
    assert combos == {(s, w) for s in (128, 256, 512) for w in (1, 2)}
    assert all(c.config.num_heads == 2 and c.config.kernel == "dense" for c in cells)
    assert cells[0].axes == {"seq_len": 128, "world_size": 1, "batch_size": 2, "head_dim": 16}


def test_cell_key_is_sha256_of_the_normalized_config() -> None:
    (a,) = expand(SweepSpec(name="a", base={"kernel": "dense", "seq_len": 64}))
    (b,) = expand(SweepSpec(name="b", base={"kernel": "dense", "seq_len": 64, "num_heads": 8}))
    (c,) = expand(SweepSpec(name="c", base={"kernel": "dense", "seq_len": 128}))
    assert a.cell_key == b.cell_key  # num_heads=8 is the default: the same normalized config
    assert a.cell_key != c.cell_key
    assert len(a.cell_key) == 64
    normalized = RunConfig(
        kernel="dense", seq_len=64, params={"document_lengths": None, "mask": None}
    )
    assert a.cell_key == cell_key(normalized)
    assert a.config_json == a.config.model_dump(mode="json")


def test_params_defaults_are_filled_and_params_axes_apply(blocked_kernel: str) -> None:
    cells = expand(
        SweepSpec(
            name="p",
            base={"kernel": blocked_kernel, "seq_len": 1024},
            grid={"params.block_size": [64, 128]},
        )
    )
    assert [c.config.params for c in cells] == [
        {"block_size": 64, "segments": [64]},
        {"block_size": 128, "segments": [64]},
    ]


def test_run_config_error_in_a_grid_value_points_at_that_value(blocked_kernel: str) -> None:
    errs = errors_of(
        {
            "name": "bad",
            "base": {"kernel": blocked_kernel, "params": {"block_size": 64}, "world_size": 2},
            "grid": {"seq_len": [256, 320, 512]},
        }
    )
    assert len(errs) == 1
    assert errs[0]["loc"] == ["grid", "seq_len", 1]
    assert "do not split into blocks of 64" in errs[0]["msg"]
    assert "(cell seq_len=320)" in errs[0]["msg"]


def test_param_errors_point_at_the_param(blocked_kernel: str) -> None:
    errs = errors_of(
        {
            "name": "bad",
            "base": {"kernel": blocked_kernel, "seq_len": 1024},
            "grid": {"params.block_size": [64, 48]},
        }
    )
    assert [e["loc"] for e in errs] == [["grid", "params.block_size", 1]]
    assert "must be a power of two, got 48" in errs[0]["msg"]
    assert "cell params.block_size=48" in errs[0]["msg"]

    errs = errors_of(
        {"name": "bad", "base": {"kernel": blocked_kernel, "seq_len": 64, "params": {"bs": 1}}}
    )
    assert errs[0]["loc"] == ["base", "params", "bs"]
    assert "unknown parameter" in errs[0]["msg"] and "block_size" in errs[0]["msg"]

    errs = errors_of(
        {
            "name": "bad",
            "base": {"kernel": blocked_kernel, "seq_len": 64, "params": {"block_size": "64"}},
        }
    )
    assert errs[0]["loc"] == ["base", "params", "block_size"]
    assert "integer" in errs[0]["msg"]


def test_unknown_kernel_and_world_size_errors_name_the_field() -> None:
    errs = errors_of({"name": "k", "base": {"seq_len": 64}, "grid": {"kernel": ["dense", "nope"]}})
    assert errs[0]["loc"] == ["grid", "kernel", 1]
    assert "unknown kernel 'nope'" in errs[0]["msg"]

    errs = errors_of({"name": "w", "base": {"kernel": "dense", "seq_len": 64, "world_size": 0}})
    assert errs[0]["loc"] == ["base", "world_size"]
    assert "greater than or equal to 1" in errs[0]["msg"]

    # dense runs in one process: several ranks only with parallel=data
    errs = errors_of(
        {"name": "w", "base": {"kernel": "dense", "seq_len": 64}, "grid": {"world_size": [1, 2]}}
    )
    assert errs[0]["loc"] == ["grid", "world_size", 1]
    assert "parallel=data" in errs[0]["msg"]


def test_ring_default_layout_rule_follows_causal() -> None:
    """Without a layout a ring shards zigzag when causal (seq_len % 2W), contiguous when not."""
    base = {"kernel": "ring", "seq_len": 12, "world_size": 4}
    assert len(expand(SweepSpec(name="r", base=base))) == 1  # non-causal: contiguous
    errs = errors_of({"name": "r", "base": base, "grid": {"causal": [False, True]}})
    assert errs[0]["loc"] == ["base", "seq_len"]  # the field the rule names
    assert (
        "12 must be divisible by 2 x world_size = 8 for layout 'zigzag' (cell causal=True)"
        in errs[0]["msg"]
    )


def test_data_parallel_rules_come_from_run_config() -> None:
    cells = expand(
        SweepSpec(
            name="dp",
            base={"kernel": "dense", "seq_len": 64, "parallel": "data", "batch_size": 2},
            grid={"world_size": [1, 2]},
        )
    )
    assert [c.config.local_batch for c in cells] == [2, 1]
    errs = errors_of(
        {
            "name": "dp",
            "base": {"kernel": "dense", "seq_len": 64, "parallel": "data", "batch_size": 3},
            "grid": {"world_size": [1, 2]},
        }
    )
    assert errs[0]["loc"] == ["grid", "world_size", 1]  # the varying value that breaks it
    assert "batch_size (3) must be divisible by world_size (2)" in errs[0]["msg"]


def test_structure_errors() -> None:
    errs = errors_of(
        {
            "name": "s",
            "base": {"kernel": "dense", "seq_len": 64, "colour": "red"},
            "grid": {"heads": [1], "seq_len": []},
            "zip": {"batch_size": [1, 2], "head_dim": [16]},
        }
    )
    locs = [e["loc"] for e in errs]
    assert ["base", "colour"] in locs
    assert ["grid", "heads"] in locs
    assert ["grid", "seq_len"] in locs
    assert ["zip", "head_dim"] in locs


def test_grid_over_the_limit_is_rejected_before_expansion() -> None:
    side = 1000
    spec = SweepSpec(
        name="huge",
        base={"kernel": "dense"},
        grid={"seq_len": list(range(1, side + 1)), "batch_size": list(range(1, side + 1))},
    )
    assert side * side > MAX_CELLS
    with pytest.raises(SpecError) as info:
        expand(spec)
    (err,) = info.value.errors
    assert err["loc"] == ["grid"]
    assert "1,000,000 cells" in err["msg"]


def test_duplicate_cells_are_rejected() -> None:
    errs = errors_of({"name": "d", "base": {"kernel": "dense"}, "grid": {"seq_len": [64, 64]}})
    assert "duplicate cell" in errs[0]["msg"]


def test_max_seq_len_search_block() -> None:
    (cell,) = expand(
        SweepSpec.model_validate(
            {
                "name": "m",
                "kind": "max_seq_len",
                "base": {"kernel": "dense"},
                "search": {"start": 256, "max": 4096, "granularity": 256},
            }
        )
    )
    assert cell.config.search is not None and cell.config.search.max == 4096
    assert cell.config.seq_len == 256
    errs = errors_of(
        {"name": "m", "kind": "max_seq_len", "base": {"kernel": "dense"}, "grid": {"seq_len": [1]}}
    )
    assert errs[0]["loc"] == ["grid", "seq_len"]
    errs = errors_of({"name": "m", "base": {"kernel": "dense", "seq_len": 64}, "search": {}})
    assert errs[0]["loc"] == ["search"]


def test_max_seq_len_without_a_search_block_is_refused() -> None:
    """No silent default search (up to 16,777,216 tokens): the block is required."""
    (err,) = errors_of({"name": "m", "kind": "max_seq_len", "base": {"kernel": "dense"}})
    assert (err["loc"], err["type"]) == (["search"], "missing")
    assert err["msg"].startswith(
        "a max_seq_len sweep needs a search block (start, max, granularity)"
    )


def test_a_missing_field_is_named_where_it_would_be_written() -> None:
    errs = errors_of({"name": "n", "base": {"kernel": "dense"}})
    assert [(e["loc"], e["msg"]) for e in errs] == [(["base", "seq_len"], "Field required")]
    errs = errors_of({"name": "n", "base": {}, "zip": {"seq_len": [64, 128]}})
    assert [e["loc"] for e in errs] == [["base", "kernel"]]
    assert errs[0]["msg"] == "Field required (cell seq_len=64)"


def test_correctness_kind_checks_every_cell() -> None:
    (cell,) = expand(
        SweepSpec(name="c", kind="correctness", base={"kernel": "dense", "seq_len": 64})
    )
    assert cell.config.correctness_check is True
    errs = errors_of(
        {
            "name": "c",
            "kind": "correctness",
            "base": {"kernel": "dense", "seq_len": 64, "correctness_check": False},
        }
    )
    assert errs[0]["loc"] == ["base", "correctness_check"]


def test_multihead_layer_shape_comes_from_the_cell() -> None:
    """A multihead cell's embed_dim / num_heads are its num_heads x head_dim: unset, they stay
    None in the stored config (the worker sets them); a contradicting value is refused at the
    param, by RunConfig and by the sweep's expansion."""
    cells = expand(
        SweepSpec(
            name="mh",
            base={"kernel": "multihead", "seq_len": 64, "num_heads": 2},
            grid={"head_dim": [16, 32]},
        )
    )
    assert [(c.config.params["embed_dim"], c.config.params["num_heads"]) for c in cells] == [
        (None, None),
        (None, None),
    ]
    with pytest.raises(ValidationError) as info:
        RunConfig(
            kernel="multihead", params={"embed_dim": 512}, seq_len=64, num_heads=2, head_dim=16
        )
    (error,) = info.value.errors()
    assert str(error["ctx"]["error"]).startswith(
        "params.embed_dim: 512 contradicts the run's num_heads x head_dim = 2 x 16 = 32"
    )

    base = {"kernel": "multihead", "seq_len": 64, "num_heads": 2, "head_dim": 16}
    errs = errors_of({"name": "mh", "base": base, "grid": {"params.embed_dim": [32, 64]}})
    assert [e["loc"] for e in errs] == [["grid", "params.embed_dim", 1]]
    assert errs[0]["msg"].startswith("64 contradicts the run's num_heads x head_dim = 2 x 16 = 32")
    assert errs[0]["msg"].endswith("(cell params.embed_dim=64)")

    errs = errors_of({"name": "mh", "base": {**base, "params": {"num_heads": 8}}})
    assert [e["loc"] for e in errs] == [["base", "params", "num_heads"]]
    assert errs[0]["msg"].startswith("8 contradicts the run's num_heads 2")


def test_a_lone_surrogate_anywhere_in_an_example_is_a_validation_error() -> None:
    """Every key and value of every bundled example, in turn replaced by a string holding a
    lone surrogate: SweepSpec answers with a ValidationError (a 422), never another exception
    (a key under analysis.baseline.params once made pydantic raise UnicodeEncodeError, a 500
    that the API fuzz found)."""
    hostile = "abcdefg\ud800"
    tried, other = 0, []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            for where, mode in _places(doc):
                mutated = copy.deepcopy(doc)
                _replace(mutated, where, mode, hostile)
                tried += 1
                try:
                    SweepSpec.model_validate(mutated)
                except ValidationError:
                    continue
                except Exception as exc:  # what the API would answer with a 500
                    other.append(f"{path.name} {mode} {where}: {exc!r}")
    assert tried > 1000 and other == [], other[:5]


def _places(doc: Any, where: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """Every (path, "value" | "key") of a document: its leaves and containers, and its keys."""
    if where:
        yield where, "value"
        if isinstance(where[-1], str):
            yield where, "key"
    if isinstance(doc, dict):
        for key, sub in doc.items():
            yield from _places(sub, (*where, key))
    elif isinstance(doc, list):
        for i, sub in enumerate(doc):
            yield from _places(sub, (*where, i))


def _replace(doc: Any, where: tuple, mode: str, text: str) -> None:
    for step in where[:-1]:
        doc = doc[step]
    if mode == "value":
        doc[where[-1]] = text
    else:
        doc[text] = doc.pop(where[-1])
