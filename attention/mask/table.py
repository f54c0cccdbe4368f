"""The table of which kernel takes which mask kind and balance, written from the kernels'
declarations (KernelSpec.masks, KernelSpec.balances); docs/masks.md holds it between markers
and a test holds the two equal."""

from __future__ import annotations

from attention.mask.parse import KINDS
from attention.registry import KERNELS

START = "<!-- kernel-mask-table: start -->"
END = "<!-- kernel-mask-table: end -->"
NOTES = {
    "ulysses": "the masks beyond full and causal with inner dense",
}
"""What a kernel's declaration alone does not say."""


def kernel_table() -> str:
    """A markdown table: one row per built-in kernel (plugins excluded: they vary by install),
    a column per mask kind (yes: it takes that mask), and its balances (-: it takes none)."""
    head = ["kernel", *KINDS, "balance"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in sorted(KERNELS):
        spec = KERNELS[name]
        if spec.plugin is not None:
            continue
        cells = ["yes" if kind in spec.masks else "" for kind in KINDS]
        balances = ", ".join(sorted(spec.balances)) or "-"
        note = f" ({NOTES[name]})" if name in NOTES else ""
        lines.append(f"| `{name}`{note} | " + " | ".join([*cells, balances]) + " |")
    return "\n".join(lines)


def with_table(doc: str) -> str:
    """`doc` with the text between START and END replaced by kernel_table()."""
    head, start, rest = doc.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the document lacks the markers {START} ... {END}")
    return f"{head}{START}\n{kernel_table()}\n{END}{tail}"
