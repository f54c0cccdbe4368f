"""device_used_bytes: a CUDA rank's growth in the device's used bytes (cudaMemGetInfo) from its
baseline to the end of its timed iterations, beside the allocator's peak; absent on CPU.

What runs here: the difference of two readings, the CUDA meter's wiring to its reading, the CPU
path storing nothing (results.json, the run page, report.md), and a stored CUDA figure shown and
labelled on the run page and in report.md. What does not: torch.cuda.mem_get_info itself and
the figure's value on a GPU (NCCL's buffers at W > 1), which the device check reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _api_helpers import api_client

from service import leases
from service.results import write
from service.results.report_runs import DEVICE_USED
from workers.config import RunConfig
from workers.memory import DeviceUsed, PeakMeter, cuda_used_bytes, used_growth
from workers.protocol import run_case
from workers.results import outcome_of

API = "/api/v1"
SPEC = {
    "name": "memory figures",
    "base": {"device": "cpu", "dtype": "float32", "num_heads": 2, "head_dim": 16,
             "seq_len": 256, "iterations": 2, "warmup": 1, "kernel": "dense"},
}  # fmt: skip


def test_the_growth_of_two_readings() -> None:
    assert used_growth(3 << 30, (3 << 30) + 123_456) == 123_456
    assert used_growth(5 << 30, 5 << 30) == 0
    assert used_growth(5 << 30, 4 << 30) == 0  # something else freed: never negative


def test_the_device_reading_counts_from_its_baseline() -> None:
    readings = iter([1_000, 1_700, 2_500])
    used = DeviceUsed(lambda: next(readings))
    with pytest.raises(RuntimeError, match="no baseline"):
        used.growth()  # takes no reading
    used.baseline()
    assert used.growth() == 700
    assert used.growth() == 1_500  # each read against the one baseline


def test_a_cuda_meter_reads_the_device_and_a_cpu_meter_does_not() -> None:
    """The CUDA meter's reading is cuda_used_bytes of its own device (built without touching
    CUDA); the CPU meter has none, and its figure is None, not 0."""
    cuda = PeakMeter(torch.device("cuda", 1))
    assert isinstance(cuda.used, DeviceUsed)
    read = cuda.used._read
    assert read.func is cuda_used_bytes  # type: ignore[attr-defined]
    assert read.args == (torch.device("cuda", 1),)  # type: ignore[attr-defined]
    cpu = PeakMeter(torch.device("cpu"))
    assert cpu.used is None
    cpu.baseline()
    try:
        assert cpu.device_used() is None
    finally:
        cpu.stop()


def _store(client: Any, planted: int | None) -> int:
    """Run SPEC's case on this CPU and store it (with `planted` as the rank's device_used_bytes,
    a CUDA rank's figure, when given); the run's id."""
    created = client.post(f"{API}/sweeps", json=SPEC)
    assert created.status_code == 201, created.text
    sm = client.app.state.sessionmaker
    claim = leases.claim_next(sm, "test", 60.0)
    assert claim is not None
    case = run_case(RunConfig.model_validate(claim.config))
    assert case.status == "ok" and case.result is not None, case.error
    assert case.result.device_used_bytes is None  # CPU: absent
    if planted is not None:
        result = case.result.model_copy(update={"device_used_bytes": planted})
        case = case.model_copy(update={"result": result})
    assert write.finish(sm, claim, write.completion_from_outcome(outcome_of([case], 1)))
    return int(created.json()["id"])


def test_cpu_stores_nothing_and_the_pages_show_nothing(tmp_path: Any) -> None:
    with api_client(f"sqlite:///{tmp_path / 'cpu.db'}") as client:
        sweep = _store(client, None)
        (row,) = client.get(f"{API}/sweeps/{sweep}/results.json").json()
        (rank,) = client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
        assert "device_used_bytes" in rank and rank["device_used_bytes"] is None
        page = client.get(f"/runs/{row['run_id']}").text
        assert ">device used</th>" not in page and "cudaMemGetInfo" not in page
        report = client.get(f"{API}/sweeps/{sweep}/report.md").text
        assert "Device used" not in report


def test_a_cuda_figure_is_shown_and_labelled_beside_the_peak(tmp_path: Any) -> None:
    planted = (1 << 30) + 12_345_678
    shown = f"{planted / 2**30:.2f} GiB"  # the stored bytes in binary units, as both pages show
    with api_client(f"sqlite:///{tmp_path / 'cuda.db'}") as client:
        sweep = _store(client, planted)
        (row,) = client.get(f"{API}/sweeps/{sweep}/results.json").json()
        (rank,) = client.get(f"{API}/runs/{row['run_id']}").json()["rank_results"]
        assert rank["device_used_bytes"] == planted
        page = client.get(f"/runs/{row['run_id']}").text
        assert ">device used</th>" in page and "max_memory_allocated" in page
        assert f"<td>{shown}</td>" in page
        report = client.get(f"{API}/sweeps/{sweep}/report.md").text
        table = report.split("## Results per run and sequence length")[1].split("\n## ")[0]
        header = next(x for x in table.splitlines() if x.startswith("| Run |"))
        cells = [c.strip() for c in header.strip("|").split("|")]
        line = next(x for x in table.splitlines() if x.startswith(f"| {row['label']} |"))
        values = [c.strip() for c in line.strip("|").split("|")]
        assert values[cells.index("Device used (CUDA)")] == shown
        assert DEVICE_USED in table  # which figure is which, under the table
