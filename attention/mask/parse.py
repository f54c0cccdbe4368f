"""A run's `mask` dict -> a Mask, every field checked; ParamError names the field (mask.window).

The dicts:
- {kind: full} / {kind: causal}
- {kind: sliding_window, causal: bool, window: int >= 1}
- {kind: prefix_lm, prefix: int >= 0}
- {kind: documents, causal: bool, one of lengths | sampled | lengths_file, [window: int >= 1]}
  (`window` combines the documents with a sliding window inside each). `sampled` may also stand
  beside `lengths`, as `expand` stores it: the lengths must then be what it samples.
"""

from __future__ import annotations

from typing import Any

from attention.errors import ParamError
from attention.mask.base import Mask
from attention.mask.causal import Causal
from attention.mask.documents import Documents
from attention.mask.documents_window import DocumentsWindow
from attention.mask.full import Full
from attention.mask.lengths import check_lengths, read_lengths_file, sample_lengths
from attention.mask.prefix_lm import PrefixLM
from attention.mask.sliding_window import SlidingWindow

KINDS = ("full", "causal", "sliding_window", "documents", "prefix_lm")
FIELDS = {
    "full": set(),
    "causal": set(),
    "sliding_window": {"causal", "window"},
    "prefix_lm": {"prefix"},
    "documents": {"causal", "lengths", "sampled", "lengths_file", "window"},
}
"""The fields each kind takes besides `kind`."""


def parse(spec: Any, seq_len: int | None = None, path: str = "mask") -> Mask:
    """The Mask `spec` describes, checked against seq_len when given (sampled lengths and
    lengths files need it)."""
    mask = spec if isinstance(spec, Mask) else _parse_dict(spec, seq_len, path)
    if seq_len is not None:
        mask.check(seq_len)
    return mask


def expand(spec: Any, seq_len: int) -> dict[str, Any]:
    """`spec` as a run stores it: document lengths sampled or read from a file written out into
    `lengths` (a sampled spec is kept beside them, so they can be reproduced)."""
    return parse(spec, seq_len).to_dict()


def from_legacy(causal: bool, document_lengths: Any) -> dict[str, Any]:
    """The mask of the older spelling `causal` + `params.document_lengths`."""
    if not isinstance(causal, bool):
        raise ParamError("causal", f"expected true or false, got {causal!r}")
    if document_lengths is None:
        return {"kind": "causal" if causal else "full"}
    lengths = check_lengths(document_lengths, "params.document_lengths")
    return {"kind": "documents", "causal": causal, "lengths": list(lengths)}


def _parse_dict(spec: Any, seq_len: int | None, path: str) -> Mask:
    if not isinstance(spec, dict):
        raise ParamError(path, f"expected a mapping with a `kind`, got {spec!r}")
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ParamError(f"{path}.kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    for key in spec:
        if key != "kind" and key not in FIELDS[kind]:
            known = ", ".join(sorted(FIELDS[kind])) or "none"
            raise ParamError(f"{path}.{key}", f"unknown field for kind {kind} (known: {known})")
    if kind == "full":
        return Full()
    if kind == "causal":
        return Causal()
    if kind == "sliding_window":
        return SlidingWindow(_int(spec, "window", path, 1), _bool(spec, "causal", path))
    if kind == "prefix_lm":
        return PrefixLM(_int(spec, "prefix", path, 0))
    return _documents(spec, seq_len, path)


def _documents(spec: dict[str, Any], seq_len: int | None, path: str) -> Documents:
    causal = _bool(spec, "causal", path)
    sources = [key for key in ("lengths", "sampled", "lengths_file") if key in spec]
    if not sources:
        raise ParamError(path, "documents need one of lengths, sampled, lengths_file")
    if len(sources) > 1 and sources != ["lengths", "sampled"]:
        raise ParamError(f"{path}.{sources[1]}", f"give one of {' and '.join(sources)}, not both")
    sampled = None
    if "lengths" in spec:
        lengths = check_lengths(spec["lengths"], f"{path}.lengths")
    elif seq_len is None:
        raise ParamError(f"{path}.{sources[0]}", "needs the run's seq_len to expand")
    elif "lengths_file" in spec:
        lengths = read_lengths_file(spec["lengths_file"], f"{path}.lengths_file")
    else:
        lengths = sample_lengths(spec["sampled"], seq_len, f"{path}.sampled")
    if "sampled" in spec:
        sampled = dict(spec["sampled"])
        drawn = sample_lengths(sampled, sum(lengths), f"{path}.sampled")
        if drawn != lengths:
            raise ParamError(f"{path}.lengths", "differ from what `sampled` draws")
    if "window" in spec:
        window = _int(spec, "window", path, 1)
        return DocumentsWindow(lengths, causal, window=window, sampled=sampled)
    return Documents(lengths, causal, sampled=sampled)


def _int(spec: dict[str, Any], key: str, path: str, minimum: int) -> int:
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ParamError(f"{path}.{key}", f"expected an integer >= {minimum}, got {value!r}")
    return value


def _bool(spec: dict[str, Any], key: str, path: str) -> bool:
    value = spec.get(key)
    if not isinstance(value, bool):
        raise ParamError(f"{path}.{key}", f"expected true or false, got {value!r}")
    return value
