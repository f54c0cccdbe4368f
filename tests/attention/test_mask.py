"""attention.mask: every kind's predicate, block map and kept-pair count against brute-force
(S, S) masks written from the definitions here (python loops over (q, k)), edge cases
included; the window's flash-attn meaning; the legacy spelling; sampled and file lengths;
bad input refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attention import documents
from attention.errors import ParamError
from attention.mask import Documents, expand, from_legacy, parse, sample_lengths

pytestmark = pytest.mark.timeout(120)


def doc_ids(lengths: list[int]) -> list[int]:
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def brute(spec: dict[str, Any], s: int) -> torch.Tensor:
    """keep (S, S) from the mask's definition, one (q, k) at a time."""
    kind = spec["kind"]
    doc = doc_ids(spec["lengths"]) if kind == "documents" else [0] * s
    w = spec.get("window", s + 1)
    causal = spec.get("causal", kind == "causal")

    def keep(q: int, k: int) -> bool:
        if kind == "full":
            return True
        if kind == "prefix_lm":
            return k <= q or k < spec["prefix"]
        near = abs(q - k) < w and doc[q] == doc[k]
        return near and (k <= q or not causal)

    return torch.tensor([[keep(q, k) for k in range(s)] for q in range(s)])


CASES = [
    ({"kind": "full"}, 1),
    ({"kind": "full"}, 13),
    ({"kind": "causal"}, 1),
    ({"kind": "causal"}, 17),
    ({"kind": "sliding_window", "causal": True, "window": 1}, 11),
    ({"kind": "sliding_window", "causal": False, "window": 1}, 11),
    ({"kind": "sliding_window", "causal": True, "window": 4}, 19),
    ({"kind": "sliding_window", "causal": False, "window": 4}, 19),
    ({"kind": "sliding_window", "causal": True, "window": 19}, 19),
    ({"kind": "sliding_window", "causal": False, "window": 40}, 19),
    ({"kind": "prefix_lm", "prefix": 0}, 14),
    ({"kind": "prefix_lm", "prefix": 1}, 14),
    ({"kind": "prefix_lm", "prefix": 6}, 14),
    ({"kind": "prefix_lm", "prefix": 14}, 14),
    ({"kind": "documents", "causal": True, "lengths": [23]}, 23),
    ({"kind": "documents", "causal": False, "lengths": [23]}, 23),
    ({"kind": "documents", "causal": True, "lengths": [1] * 15}, 15),
    ({"kind": "documents", "causal": False, "lengths": [1, 2, 1, 1, 3, 1]}, 9),
    ({"kind": "documents", "causal": True, "lengths": [5, 9, 1, 7, 3]}, 25),
    ({"kind": "documents", "causal": False, "lengths": [5, 9, 1, 7, 3]}, 25),
    ({"kind": "documents", "causal": True, "lengths": [5, 9, 1, 7, 3], "window": 1}, 25),
    ({"kind": "documents", "causal": True, "lengths": [5, 9, 1, 7, 3], "window": 3}, 25),
    ({"kind": "documents", "causal": False, "lengths": [5, 9, 1, 7, 3], "window": 3}, 25),
    ({"kind": "documents", "causal": False, "lengths": [5, 9, 1, 7, 3], "window": 30}, 25),
]
IDS = [f"{spec['kind']}-{i}" for i, (spec, _) in enumerate(CASES)]


@pytest.mark.parametrize(("spec", "s"), CASES, ids=IDS)
def test_predicate_and_pairs_match_brute_force(spec: dict[str, Any], s: int) -> None:
    keep = brute(spec, s)
    mask = parse(spec, s)
    assert torch.equal(mask.dense(s), keep)
    rows = torch.tensor([s - 1, 0, s // 2])
    assert torch.equal(mask.rows(rows, s), keep[rows])
    assert torch.equal(mask.row_pairs(s), keep.sum(1))
    assert mask.pairs(s) == int(keep.sum())
    assert mask.pairs(s) == int(mask.row_pairs(s).sum())
    if mask.causal:  # a property of the kind: no key after its query at any length
        assert not keep.triu(1).any()
    assert parse(mask.to_dict(), s) == mask


@pytest.mark.parametrize(("spec", "s"), CASES, ids=IDS)
@pytest.mark.parametrize("block", [1, 3, 4, 8, 64])
def test_block_map_matches_brute_force(spec: dict[str, Any], s: int, block: int) -> None:
    """Exact at block sizes that divide S, that do not (short last block) and above S."""
    keep = brute(spec, s)
    n = -(-s // block)
    padded = torch.zeros(n * block, n * block, dtype=torch.int64)
    padded[:s, :s] = keep
    tiles = padded.view(n, block, n, block).sum((1, 3))
    exists = torch.zeros(n * block, dtype=torch.int64)
    exists[:s] = 1
    area = exists.view(n, block).sum(1)
    got = parse(spec, s).blocks(s, block)
    assert torch.equal(got.pairs, tiles)
    assert torch.equal(got.kept, tiles > 0)
    assert torch.equal(got.full, tiles == area[:, None] * area[None, :])
    assert torch.equal(got.partial, (tiles > 0) & (tiles < area[:, None] * area[None, :]))


def test_block_map_at_length_without_dense_mask() -> None:
    """At 64K tokens (an (S, S) mask would be 4 GiB) the tiles sum to the closed-form count and
    match the causal closed form tile by tile."""
    s, block = 1 << 16, 128
    lengths = [4096, 1000, 30000, 536, 29904]
    mask = parse({"kind": "documents", "causal": True, "lengths": lengths}, s)
    assert int(mask.blocks(s, block).pairs.sum()) == sum(n * (n + 1) // 2 for n in lengths)
    for spec in (
        {"kind": "sliding_window", "causal": True, "window": 4096},
        {"kind": "sliding_window", "causal": False, "window": 333},
        {"kind": "prefix_lm", "prefix": 2048},
        {"kind": "documents", "causal": True, "lengths": lengths, "window": 2000},
    ):
        other = parse(spec, s)
        assert int(other.blocks(s, 1000).pairs.sum()) == other.pairs(s), spec
    tiles = parse({"kind": "causal"}).blocks(s, block).pairs
    n = s // block
    want = torch.full((n, n), block * block).tril(-1) + torch.eye(n, dtype=torch.int64) * (
        block * (block + 1) // 2
    )
    assert torch.equal(tiles, want)


@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_window_is_flash_attn_window_size(window: int, causal: bool) -> None:
    """flash-attn's window_size (left, right) keeps k in [q - left, q + right]."""
    s = 12
    mask = parse({"kind": "sliding_window", "causal": causal, "window": window})
    left, right = mask.flash_window
    assert (left, right) == (window - 1, 0 if causal else window - 1)
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    assert torch.equal(mask.dense(s), (k >= q - left) & (k <= q + right))
    if causal:
        assert bool((mask.dense(s).sum(1)[window - 1 :] == window).all())


@pytest.mark.parametrize("causal", [False, True])
def test_legacy_spelling_is_the_same_mask(causal: bool) -> None:
    lengths = [10, 30, 7, 1, 48]
    spec = from_legacy(causal, lengths)
    assert spec == {"kind": "documents", "causal": causal, "lengths": lengths}
    assert torch.equal(parse(spec, 96).dense(96), brute(spec, 96))
    assert torch.equal(documents.document_mask(lengths, causal), brute(spec, 96))
    assert documents.pairs(lengths, causal) == int(brute(spec, 96).sum())
    assert from_legacy(causal, None) == {"kind": "causal" if causal else "full"}


SAMPLED = {"distribution": "lognormal", "mean": 2048, "max_fraction": 0.25, "seed": 3}


@pytest.mark.parametrize(
    "sampled",
    [
        SAMPLED,
        {**SAMPLED, "sigma": 0.5, "multiple_of": 64},
        {"distribution": "uniform", "mean": 300, "max_fraction": 0.02, "seed": 0},
        {"distribution": "uniform", "mean": 10, "max_fraction": 1.0, "seed": 7, "multiple_of": 8},
    ],
)
def test_sampled_lengths_are_deterministic_and_bounded(sampled: dict[str, Any]) -> None:
    s = 1 << 15
    lengths = sample_lengths(sampled, s)
    assert lengths == sample_lengths(dict(sampled), s)
    assert lengths != sample_lengths({**sampled, "seed": sampled["seed"] + 1}, s)
    assert sum(lengths) == s
    assert max(lengths) <= sampled["max_fraction"] * s
    unit = sampled.get("multiple_of", 1)
    assert all(n >= unit and n % unit == 0 for n in lengths)


def test_sampled_means_follow_the_spec() -> None:
    """Many short documents: the realised mean is near `mean` (cap and last cut aside)."""
    s = 1 << 18
    for dist in ("uniform", "lognormal"):
        lengths = sample_lengths({**SAMPLED, "distribution": dist, "mean": 100}, s)
        assert 90 < s / len(lengths) < 110, dist
    longtail = sample_lengths({**SAMPLED, "mean": 100, "sigma": 2.0}, s)
    even = sample_lengths({**SAMPLED, "mean": 100, "distribution": "uniform"}, s)
    assert max(longtail) > 5 * max(even)  # lognormal's long tail


def test_expand_stores_sampled_lengths_and_reparses() -> None:
    s = 16384
    spec = {"kind": "documents", "causal": True, "sampled": SAMPLED, "window": 512}
    stored = expand(spec, s)
    assert stored["lengths"] == list(sample_lengths(SAMPLED, s))
    assert stored["sampled"] == SAMPLED and stored["window"] == 512
    mask = parse(stored)  # no seq_len needed once expanded
    assert mask == parse(spec, s)
    assert isinstance(mask, Documents)
    summary = mask.summary()
    assert summary["count"] == len(stored["lengths"])
    assert summary["max"] == max(stored["lengths"])
    assert summary["mean"] == s / len(stored["lengths"])


def test_lengths_file_lines_or_json(tmp_path: Path) -> None:
    lines, js = tmp_path / "lengths.txt", tmp_path / "lengths.json"
    lines.write_text("5\n9\n\n2\n")
    js.write_text(json.dumps([5, 9, 2]))
    for f in (lines, js):
        spec = {"kind": "documents", "causal": False, "lengths_file": str(f)}
        assert expand(spec, 16) == {"kind": "documents", "causal": False, "lengths": [5, 9, 2]}


def bad_cases(tmp: Path) -> list[tuple[Any, int | None, str, str]]:
    """(spec, seq_len, field path, reason fragment)."""
    doc = {"kind": "documents", "causal": True}
    smp = {"kind": "documents", "causal": True, "sampled": SAMPLED}

    def drawn(**changes: Any) -> dict[str, Any]:
        return {**smp, "sampled": {**SAMPLED, **changes}}

    bad_file = tmp / "bad.txt"
    bad_file.write_text("4\nfour\n")
    return [
        ("causal", 8, "mask", "expected a mapping"),
        ({"kind": "diagonal"}, 8, "mask.kind", "must be one of"),
        ({"kind": "full", "causal": True}, 8, "mask.causal", "unknown field"),
        ({"kind": "sliding_window", "causal": True}, 8, "mask.window", "integer >= 1"),
        ({"kind": "sliding_window", "causal": True, "window": 0}, 8, "mask.window", ">= 1"),
        ({"kind": "sliding_window", "causal": True, "window": 2.5}, 8, "mask.window", "integer"),
        ({"kind": "sliding_window", "causal": True, "window": True}, 8, "mask.window", "integer"),
        ({"kind": "sliding_window", "window": 4}, 8, "mask.causal", "true or false"),
        ({"kind": "prefix_lm", "prefix": -1}, 8, "mask.prefix", ">= 0"),
        ({"kind": "prefix_lm", "prefix": 9}, 8, "mask.prefix", "longer than seq_len 8"),
        (doc, 8, "mask", "one of lengths, sampled, lengths_file"),
        ({**doc, "lengths": [8], "lengths_file": "x"}, 8, "mask.lengths_file", "not both"),
        ({**doc, "lengths": [3, 0, 5]}, 8, "mask.lengths", "integer >= 1"),
        ({**doc, "lengths": []}, 0, "mask.lengths", "non-empty"),
        ({**doc, "lengths": [3, 4]}, 8, "mask.lengths", "sum to 7, but seq_len is 8"),
        ({**doc, "lengths": [8], "window": 0}, 8, "mask.window", ">= 1"),
        ({**doc, "causal": None, "lengths": [8]}, 8, "mask.causal", "true or false"),
        (smp, None, "mask.sampled", "seq_len"),
        ({**smp, "lengths": [4096] * 4}, 16384, "mask.lengths", "differ from what"),
        (drawn(distribution="zipf"), 64, "mask.sampled.distribution", "one of"),
        (drawn(max_fraction=0), 64, "mask.sampled.max_fraction", "(0, 1]"),
        (drawn(max_fraction=1.5), 64, "mask.sampled.max_fraction", "(0, 1]"),
        (drawn(max_fraction=0.001), 64, "mask.sampled.max_fraction", "shorter"),
        (drawn(mean=0), 64, "mask.sampled.mean", ">= 1"),
        (drawn(mean=float("nan")), 64, "mask.sampled.mean", ">= 1"),
        (drawn(seed=None), 64, "mask.sampled.seed", "integer"),
        (drawn(distribution="uniform", sigma=1), 64, "mask.sampled.sigma", "only the lognormal"),
        (drawn(multiple_of=3), 64, "mask.sampled.multiple_of", "dividing seq_len 64"),
        (drawn(shape=2), 64, "mask.sampled.shape", "unknown field"),
        ({**doc, "lengths_file": str(tmp / "absent.txt")}, 8, "mask.lengths_file", "cannot read"),
        ({**doc, "lengths_file": str(bad_file)}, 8, "mask.lengths_file", "line 2"),
    ]


def test_bad_input_names_the_field(tmp_path: Path) -> None:
    for spec, s, path, reason in bad_cases(tmp_path):
        with pytest.raises(ParamError) as caught:
            parse(spec, s)
        assert ".".join(caught.value.path) == path, (spec, str(caught.value))
        assert reason in caught.value.reason, (spec, str(caught.value))
    with pytest.raises(ParamError, match=r"^causal: expected true or false"):
        from_legacy("yes", None)  # type: ignore[arg-type]
    with pytest.raises(ParamError, match=r"^params\.document_lengths: expected a non-empty"):
        from_legacy(True, [])
