"""The plan each run ran, where its stored config leaves it to the device.

A run with `plan: auto` and device auto keeps auto in its stored config (its cell, and so its
key, stays as submitted); its ranks report the plan they ran (workers.results.RankResult.plan),
which RunRow.plan joins. report.md states it here, results.json and results.csv carry it as
the plan column and the run page beside the run's setup: the same field everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.results.rows import RunRow


def chosen_on_device(row: RunRow) -> bool:
    """Whether the row's plan was chosen on the rank: its params say auto and a rank ran one."""
    return row.plan is not None and row.params.get("plan") == "auto"


def plan_notes(rows: Sequence[RunRow]) -> list[str]:
    """report.md's line naming the plan `plan: auto` ran as on each run that left it to the
    device, grouped by plan; nothing when no run did."""
    by_plan: dict[str, list[int]] = {}
    for row in rows:
        if chosen_on_device(row):
            by_plan.setdefault(str(row.plan), []).append(row.run_id)
    if not by_plan:
        return []
    parts = [
        f"{plan} on run{'s' if len(ids) > 1 else ''} {', '.join(str(i) for i in sorted(ids))}"
        for plan, ids in sorted(by_plan.items())
    ]
    return [
        "**Plan** (`plan: auto` with device auto: the device chose on the rank; results.csv's "
        "plan column): ran as " + " · ".join(parts),
        "",
    ]
