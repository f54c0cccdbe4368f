"""A run-level `mask` in a sweep spec, turned into the one form a run stores.

A spec may describe a run's mask at run level (`mask: {kind: documents, causal: true,
lengths: [...]}`, in base or as an axis) beside the older spellings `causal: true` and
`params.mask`. Every spelling of the same mask stores the same config (and so the same cell
key), the form `causal` and `params.mask` already store:

- {kind: full}: `causal: false`, no params.mask;
- {kind: causal}: `causal: true`, no params.mask;
- any other kind: `params.mask` (a sampled one written out later, as for params.mask) and
  `causal` the mask's own.

A contradiction is an error naming the field, never a silent choice: a run-level mask beside
params.mask or params.document_lengths, or an explicit `causal` the mask disagrees with.

The older `params.document_lengths: [...]` is stored the same way (`lengths_as_mask`):
`params.mask = {kind: documents, causal: <the cell's causal>, lengths: [...]}` and no
document_lengths, for each kernel whose params take a documents `mask` beside
document_lengths (dense, ring, ulysses). On the ring that is the same run: document_lengths ran
on contiguous shards (`layout: contiguous`, the non-causal default, or a balance's order) and the
mask runs on those shards with the same blocks (a document under 8 tokens is one masked block:
the same pairs). A ring cell with layout zigzag, or a causal one with no layout, was refused
before and now runs as the run-level documents mask does, on zigzag shards. A kernel whose
params take no `mask` (an adapter such as ring_flash_attn, which hands the lengths to its own
varlen call) keeps document_lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attention
from attention.errors import ParamError
from attention.mask import from_legacy, parse
from attention.mask.takes import LEGACY_MASKS, kernel_mask
from workers.resolved import EXPANDED_SOURCES, needs_length

RUN_MASK = "mask"
"""The run-level field a spec may give (not a RunConfig field: expansion moves it)."""

Problems = list[tuple[tuple[str | int, ...], str]]


def _probe(mask: dict[str, Any]) -> dict[str, Any]:
    """The mask with documents still to be drawn at the run's seq_len standing as one
    document, so its kind and causality are checked now (the draw is checked once expanded)."""
    if not needs_length(mask):
        return mask
    kept = {k: v for k, v in mask.items() if k not in EXPANDED_SOURCES}
    return {**kept, "lengths": [1]}


def apply_run_mask(raw: dict[str, Any]) -> Problems:
    """Move a run-level `mask` of the raw cell config `raw` (changed in place) into the
    stored form (module docstring); the problems as (path, reason), the path where the user
    wrote the value (mask, causal). No `mask`: nothing changes."""
    if RUN_MASK not in raw:
        return []
    mask = raw.pop(RUN_MASK)
    params = raw.get("params")
    if isinstance(params, dict):
        for name in ("mask", "document_lengths"):
            if params.get(name) is not None:
                reason = f"give the mask here or as params.{name}, not both"
                return [((RUN_MASK,), reason)]
    try:
        parsed = parse(_probe(mask) if isinstance(mask, dict) else mask, path=RUN_MASK)
    except ParamError as e:
        return [(e.path, e.reason)]
    causal = raw.get("causal")
    if isinstance(causal, bool) and causal != parsed.causal:
        reason = (
            f"the mask {parsed.kind} is {'causal' if parsed.causal else 'not causal'}; "
            f"leave causal out or set it to {str(parsed.causal).lower()}"
        )
        return [(("causal",), reason)]
    if not isinstance(causal, bool) and "causal" in raw:
        return []  # RunConfig reports a causal that is no bool, at causal
    raw["causal"] = parsed.causal
    if parsed.kind in LEGACY_MASKS:
        return []
    kernel = raw.get("kernel")
    spec = attention.KERNELS.get(kernel) if isinstance(kernel, str) else None
    if isinstance(kernel, str) and spec is not None and parsed.kind not in spec.masks:
        try:  # its message names the kernel and the masks it takes
            kernel_mask(parsed, kernel, spec.masks)
        except ParamError as e:
            return [((RUN_MASK,), e.reason)]
    if isinstance(params, dict):  # else the params' own error is reported
        raw["params"] = {**params, "mask": mask}
    return []


def _takes_both(kernel: Any) -> bool:
    """Whether `kernel`'s params take document_lengths and a documents `mask` beside it."""
    spec = attention.KERNELS.get(kernel) if isinstance(kernel, str) else None
    if spec is None or "documents" not in spec.masks or not dataclasses.is_dataclass(spec.params):
        return False
    return {"document_lengths", "mask"} <= {f.name for f in dataclasses.fields(spec.params)}


def lengths_as_mask(raw: dict[str, Any]) -> bool:
    """Whether the raw cell config `raw` is one whose params.document_lengths is stored as a
    documents mask: set, beside no params.mask (the kernel refuses both, at
    params.document_lengths), for a kernel that takes both spellings, with a bool causal."""
    params = raw.get("params")
    if not isinstance(params, dict) or params.get("document_lengths") is None:
        return False
    return (
        params.get("mask") is None and _takes_both(raw.get("kernel")) and _causal(raw) is not None
    )


def _causal(raw: dict[str, Any]) -> bool | None:
    """The cell's causal as RunConfig will hold it (a model cell's is true), None when it is no
    bool (RunConfig reports it at causal)."""
    causal = raw.get("causal", raw.get("workload") == "model")
    return causal if isinstance(causal, bool) else None


def apply_document_lengths(raw: dict[str, Any]) -> Problems:
    """Store params.document_lengths of `raw` (changed in place) as the documents mask it
    means when `lengths_as_mask`; the problems as (path, reason), a bad length at
    params.document_lengths. Otherwise nothing changes."""
    if not lengths_as_mask(raw):
        return []
    params = raw["params"]
    try:
        mask = from_legacy(bool(_causal(raw)), params["document_lengths"])
    except ParamError as e:
        return [(e.path, e.reason)]
    kept = {k: v for k, v in params.items() if k != "document_lengths"}
    raw["params"] = {**kept, "mask": mask}
    return []
