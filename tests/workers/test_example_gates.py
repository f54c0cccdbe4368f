"""Every cell of every bundled cpu-* example passes the correctness gate at its own settings,
cut down in length only: the shortest length the kernel takes from CHECK_MIN_LEN on
(workers.inputs.shorter_length), every row checked. Cells alike in everything the gate reads are
checked once; ring kernels on real gloo ranks at the example's world size."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import pytest
import torch
from _dist_helpers import run_ranks

from service.cli.specs import load_specs
from service.spec import SweepSpec, expand
from workers.config import RunConfig
from workers.gate import CHECK_MIN_LEN, run_gate
from workers.inputs import shorter_length

CPU = torch.device("cpu")
CPU_EXAMPLES = sorted(
    p.name
    for p in files("service.examples").iterdir()
    if p.name.startswith("cpu-") and p.name.endswith(".yaml")
)
GATE_FIELDS = (
    "kernel", "params", "dtype", "mode", "causal", "num_heads", "head_dim", "num_kv_heads",
    "batch_size", "seed", "world_size", "parallel", "seq_len",
)  # fmt: skip
"""What the gate reads of a config (cells differing elsewhere are gated alike)."""


def _gate_cases() -> dict[int, list[tuple[str, RunConfig]]]:
    """The distinct gated configs of every cpu-* example, cut down in length, by world size,
    each named by its first example cell."""
    cases: dict[int, dict[str, tuple[str, RunConfig]]] = {}
    for name in CPU_EXAMPLES:
        for index, doc in enumerate(load_specs(name)):
            for cell in expand(SweepSpec.model_validate(doc)):
                short = cell.config.model_copy(
                    update={"seq_len": shorter_length(cell.config, CHECK_MIN_LEN)}
                )
                key = repr([getattr(short, f) for f in GATE_FIELDS])
                label = (
                    f"{name}#{index} {short.kernel} {short.dtype} {short.mode} W={short.world_size}"
                )
                cases.setdefault(short.world_size, {}).setdefault(key, (label, short))
    return {w: list(found.values()) for w, found in sorted(cases.items())}


CASES = _gate_cases()


def rank_gates(rank: int, world: int, cases: list[tuple[str, RunConfig]]) -> list[dict[str, Any]]:
    """Run the gate of each case on this rank; what each measured and whether it passed."""
    found = []
    for label, config in cases:
        gate = run_gate(config, rank, CPU, "correctness")
        found.append(
            {
                "label": label,
                "passed": gate.passed(config.dtype),
                "summary": gate.summary(),
                "tolerance": gate.tolerance_text(config.dtype),
            }
        )
    return found


@pytest.mark.parametrize("world", sorted(CASES), ids=[f"W={w}" for w in sorted(CASES)])
def test_every_cpu_example_cell_passes_the_gate(world: int) -> None:
    cases = CASES[world]
    # a gloo group even at one rank: ring kernels run there too (ring_dilated at W=1)
    per_rank = run_ranks(rank_gates, world, cases, deadline_s=540.0)
    results = per_rank[0]
    assert all(r == results for r in per_rank), "the ranks of one run judged differently"
    failed = [
        f"{r['label']}: {r['summary']} > {r['tolerance']}" for r in results if not r["passed"]
    ]
    assert not failed, "\n".join(failed)
    assert len(results) == len(cases)
