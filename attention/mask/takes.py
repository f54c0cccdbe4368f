"""A kernel's `mask` and `balance` parameters: checked against what the kernel declares it takes
(KernelSpec.masks, KernelSpec.balances), so a mask or balance it cannot run is refused, naming
the kernel, never ignored."""

from __future__ import annotations

from typing import Any

from attention.errors import ParamError
from attention.mask.parse import KINDS, parse

LEGACY_MASKS = frozenset({"full", "causal"})
"""What a kernel takes without a `mask` parameter: full attention, causal when called so."""
ALL_MASKS = frozenset(KINDS)


def kernel_mask(value: Any, kernel: str, kinds: frozenset[str]) -> dict[str, Any] | None:
    """`value` (a run's mask dict, a Mask or None) as the dict of a mask of a kind `kernel`
    takes (parse(value).to_dict(): the form a run stores, so params stay plain data)."""
    if value is None:
        return None
    mask = parse(value)
    if mask.kind not in kinds:
        raise ParamError(
            "mask",
            f"kernel {kernel!r} takes the masks {', '.join(sorted(kinds))}, not {mask.kind}",
        )
    return mask.to_dict()


def kernel_balance(value: Any, kernel: str, balances: frozenset[str]) -> str | None:
    """`value` (None or a balance name) as a balance `kernel` takes."""
    if value is None:
        return None
    if not balances:
        raise ParamError("balance", f"kernel {kernel!r} takes no balance (it needs none)")
    if value not in balances:
        raise ParamError(
            "balance",
            f"kernel {kernel!r} takes the balances {', '.join(sorted(balances))}, not {value!r}",
        )
    return str(value)


def check_causal(value: Any, causal: bool) -> None:
    """A call's `causal` must say what its mask (a dict or a Mask; None: no mask) says (the
    mask decides; a contradiction is an error, not a silent choice)."""
    if value is None:
        return
    mask = parse(value)
    if causal != mask.causal:
        raise ParamError(
            "causal",
            f"the call says causal={causal}, but the mask {mask.kind} is "
            f"{'causal' if mask.causal else 'not causal'}; call with causal={mask.causal}",
        )


def check_fits(value: Any, seq_len: int) -> None:
    """ParamError unless the mask (a dict or a Mask; None: no mask) fits seq_len tokens."""
    if value is not None:
        parse(value, seq_len)


def check_no_lengths(mask: Any, document_lengths: Any) -> None:
    """`mask` and the older `document_lengths` are two spellings: give one."""
    if mask is not None and document_lengths is not None:
        raise ParamError(
            "params.document_lengths",
            "give the documents in `mask` ({kind: documents, lengths: ...}) or here, not both",
        )
