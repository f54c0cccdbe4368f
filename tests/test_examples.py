"""Every bundled example sweep loads (as `ringlab submit` reads it) and validates with SweepSpec:
each document expands into run configs the workers accept."""

from __future__ import annotations

import importlib.util
import re
from importlib.resources import files

import pytest

import attention
from service.cli.specs import load_specs
from service.spec import SpecError, SweepSpec, expand
from workers.errors import Infeasible
from workers.fit import check_feasible

EXAMPLES = sorted(p.name for p in files("service.examples").iterdir() if p.name.endswith(".yaml"))
GPU_EXPERIMENTS = [
    "max-seq-len-1gpu.yaml",
    "max-seq-len-2gpu.yaml",
    "dp-vs-ring-2gpu.yaml",
    "dilated-1-2gpu.yaml",
    "memory-per-token.yaml",
    "sparsity-1gpu.yaml",
    "dilated-max-len-1-2gpu.yaml",
    "training-memory-80gb.yaml",
    "compare-rings.yaml",
    "compare-flex.yaml",
    "gpu-proof.yaml",  # the device check's (scripts/device_check.sh), not a seed's experiment
]
DOCS = [(name, i) for name in EXAMPLES for i in range(len(load_specs(name)))]


def test_every_seed_experiment_has_a_gpu_sweep_and_a_cpu_twin() -> None:
    expected = {*GPU_EXPERIMENTS, *(f"cpu-{n}" for n in GPU_EXPERIMENTS), "cpu-quick.yaml"}
    expected |= {"sp-schemes-8gpu.yaml", "cpu-sp-schemes.yaml"}  # not a seed's experiment
    expected |= {"documents-8gpu.yaml", "cpu-documents.yaml"}  # masks of real training
    assert set(EXAMPLES) == expected


def _kernels(doc: dict) -> set[str]:
    names = set(doc.get("zip", {}).get("kernel", [])) | set(doc.get("grid", {}).get("kernel", []))
    return names | ({doc["base"]["kernel"]} if "kernel" in doc.get("base", {}) else set())


@pytest.mark.parametrize(("name", "index"), DOCS, ids=[f"{n}#{i}" for n, i in DOCS])
def test_example_validates(name: str, index: int) -> None:
    doc = load_specs(name)[index]
    spec = SweepSpec.model_validate(doc)
    missing = sorted(_kernels(doc) - set(attention.KERNELS))
    if missing:
        pytest.skip(f"kernel(s) {', '.join(missing)} not registered in attention.KERNELS yet")
    if name == "training-memory-80gb.yaml" and importlib.util.find_spec("bitsandbytes") is None:
        # the seed's optimized cells use adamw8bit: refused, naming the field, without it
        with pytest.raises(SpecError) as refused:
            expand(spec)
        (error,) = refused.value.errors
        assert error["loc"] == ["zip", "training.optimizer", 2]
        assert "adamw8bit needs bitsandbytes, which is not installed" in error["msg"]
        return
    cells = expand(spec)
    assert cells, name
    configs = [c.config for c in cells]
    if name.startswith("cpu-"):
        attention_only = [c for c in configs if c.workload == "attention"]
        assert {c.device for c in configs} == {"cpu"}
        assert {c.dtype for c in attention_only} <= {"float32"}
    else:
        assert {c.device for c in configs} == {"cuda"}
    for c in configs:  # a single-process kernel on several ranks must split the batch
        if not attention.KERNELS[c.kernel].distributed and c.world_size > 1:
            assert c.parallel == "data", c


def test_cpu_quick_is_a_handful_of_tiny_runs_at_one_and_two_ranks() -> None:
    (doc,) = load_specs("cpu-quick.yaml")
    configs = [c.config for c in expand(SweepSpec.model_validate(doc))]
    assert len(configs) <= 10
    assert {c.world_size for c in configs} == {1, 2}
    assert {c.parallel for c in configs} == {"sequence", "data"}
    assert max(c.seq_len for c in configs) <= 2048
    # Attention work stays under a second at the ~140 GFLOP/s of SDPA on this machine kind.
    flops = sum(
        4 * c.batch_size * c.seq_len**2 * c.num_heads * c.head_dim * (c.warmup + c.iterations)
        for c in configs
    )
    assert flops < 140e9


CPU_EXAMPLES = [name for name in EXAMPLES if name.startswith("cpu-")]
NEEDS = re.compile(r"# Needs (\d+) CPUs: \S")
"""A cpu-* example's first line when it needs more than 2 CPUs: how many, then why."""


def cpu_cluster(cpus: int) -> dict:
    """One node with `cpus` CPUs and no GPU, as workers.cluster.describe() reports it."""
    node = {"node_id": "n", "ip": "127.0.0.1", "hostname": "h", "cpus": float(cpus), "gpus": 0.0}
    node |= {"gpu_names": [], "free_cpus": float(cpus), "free_gpus": 0.0}
    return {"nodes": [node], "total_cpus": float(cpus), "total_gpus": 0.0}


@pytest.mark.parametrize("name", CPU_EXAMPLES)
def test_every_cpu_example_fits_2_cpus_unless_its_first_line_says_what_it_needs(name: str) -> None:
    first = (files("service.examples") / name).read_text().splitlines()[0]
    needs = NEEDS.match(first)
    cluster = cpu_cluster(int(needs.group(1)) if needs else 2)
    for doc in load_specs(name):
        for cell in expand(SweepSpec.model_validate(doc)):
            check_feasible(cell.config, cluster)  # raises Infeasible naming what it needs
    if needs:  # and it does need more than 2, as its first line says
        with pytest.raises(Infeasible, match=r"the run needs \d+ CPU"):
            for doc in load_specs(name):
                for cell in expand(SweepSpec.model_validate(doc)):
                    check_feasible(cell.config, cpu_cluster(2))
