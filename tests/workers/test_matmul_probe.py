"""The node's matmul rate (workers.matmul_probe): a square product timed on the real device,
recomputable from its size and seconds, measured once per node and read back afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers import matmul_probe
from workers.environment import collect


def test_the_rate_is_two_n_cubed_over_the_best_seconds() -> None:
    got = matmul_probe.measure(torch.device("cpu"), torch.float32)
    assert got.dtype == "float32"
    assert got.size in (1024, 2048)  # from MIN_SIZE: a smaller product times its call
    assert 0 < got.seconds < 1  # well under a second, even on a busy machine
    assert got.flops_per_s == pytest.approx(2 * got.size**3 / got.seconds)
    # the size doubled until the best product reached the target, or stopped at the cap
    assert got.seconds >= matmul_probe.PROBE_TARGET_S or got.size == matmul_probe.MAX_SIZE["cpu"]


def test_a_node_measures_once_and_reads_its_rate_after(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    first = matmul_probe.node_rate(cpu, torch.float32, tmp_path)
    (stored,) = tmp_path.glob("*.json")
    on_disk = json.loads(stored.read_text())
    assert (on_disk["size"], on_disk["seconds"]) == (first.size, first.seconds)
    again = matmul_probe.node_rate(cpu, torch.float32, tmp_path)
    assert again == first  # read, not measured again (a new probe's seconds would differ)
    other = matmul_probe.node_rate(cpu, torch.bfloat16, tmp_path)  # another dtype: its own
    assert other.dtype == "bfloat16" and len(list(tmp_path.glob("*.json"))) == 2
    threads = torch.get_num_threads()
    try:  # another thread count is another rate of the same CPU
        torch.set_num_threads(threads + 1)
        matmul_probe.node_rate(cpu, torch.float32, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_a_cache_file_of_another_key_is_refused(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    matmul_probe.node_rate(cpu, torch.float32, tmp_path)
    (stored,) = tmp_path.glob("*.json")
    stored.write_text(json.dumps({**json.loads(stored.read_text()), "key": "another node"}))
    with pytest.raises(RuntimeError, match="another node"):
        matmul_probe.node_rate(cpu, torch.float32, tmp_path)


def test_the_environment_carries_the_rate_of_the_runs_dtype() -> None:
    env = collect(torch.device("cpu"), torch.float32)
    assert env.matmul_dtype == "float32" and env.matmul_size and env.matmul_s
    assert env.matmul_flops_per_s == pytest.approx(2 * env.matmul_size**3 / env.matmul_s)
    assert collect(torch.device("cpu"), torch.float32).matmul_s == env.matmul_s  # once a node


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_rate_is_measured_in_bf16() -> None:
    got = matmul_probe.measure(torch.device("cuda"), torch.bfloat16)
    assert got.dtype == "bfloat16" and got.seconds > 0
    assert got.flops_per_s == pytest.approx(2 * got.size**3 / got.seconds)
