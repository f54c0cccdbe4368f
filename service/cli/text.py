"""How a terminal line names runs by state and fits names in a column: the short words the
`ls`, `show`, `watch` and `demo` lines share."""

from __future__ import annotations

from collections.abc import Sequence

STATE_WORDS = {"waiting_resources": "waiting", "timed_out": "timed out"}
"""How a terminal line names a run state."""


def state_counts(counts: dict[str, int]) -> str:
    """Runs by state: "succeeded 3, failed 1, waiting 2" (waiting: for resources)."""
    named = ((STATE_WORDS.get(state, state), n) for state, n in counts.items() if n)
    return ", ".join(f"{state} {n}" for state, n in named) or "no runs"


def cut_end(text: str, width: int) -> str:
    """The text in `width` characters, its end cut to "…" when it is longer."""
    return text if len(text) <= width else text[: width - 1] + "…"


def cut_apart(names: Sequence[str], width: int) -> list[str]:
    """Each name in `width` characters, still told apart: whole when it fits; cut at its end
    ("…") when no other name cuts alike; else its head and tail around "…" ("cpu…- dense"),
    or its tail alone, the first of these that no other cut name shares."""
    ends = [cut_end(n, width) for n in names]
    shown = []
    for name, end in zip(names, ends, strict=True):
        alike = [n for n, e in zip(names, ends, strict=True) if e == end and n != name]
        if len(name) <= width or not alike:
            shown.append(end)
            continue
        head = max(1, (width - 1) // 3)
        for keep in (head, 0):  # head and tail, then the tail alone
            cut = name[:keep] + "…" + name[len(name) - (width - 1 - keep) :]
            if all(cut != n[:keep] + "…" + n[len(n) - (width - 1 - keep) :] for n in alike):
                break
        shown.append(cut)
    return shown
