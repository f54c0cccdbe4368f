"""The device check's rehearsal (scripts/device_check.sh --cpu, issue 35): every step of the one
command a GPU machine runs, here on CPU at tiny sizes, with the venv instead of the wheelhouse.

One run of the script (one local Ray, one submission of cpu-gpu-proof.yaml); what the GPU run
alone shows (the cp312 install, CUDA, NCCL) is the device session's (docs/device.md).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "summary.txt", "facts.txt", "install.log", "cuda-tests.log", "protocol.log", "engine.log",
    "engine-report.md", "bench-gpu.md",
}  # fmt: skip
"""What OUTDIR holds: 8 files, the most the device tool brings back."""


@pytest.mark.ray_process
@pytest.mark.timeout(600)
def test_the_cpu_rehearsal_passes_every_step_into_eight_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGLAB_", "RAY_"))}
    env["DEVICE_CHECK_PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--cpu", str(out)],
        env=env, capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert done.returncode == 0, summary + done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == FILES
    steps = {line.split()[0]: line.split()[1] for line in summary.splitlines()[:-1]}
    assert steps == {"facts": "PASS", "install": "SKIP", "cuda-tests": "PASS",
                     "protocol": "PASS", "engine": "PASS", "report": "PASS",
                     "bench": "PASS"}  # fmt: skip
    text = {name: (out / name).read_text() for name in FILES}
    assert "sdpa backend for a torch.float32 call on cpu: aten::" in text["facts.txt"]
    assert "MemTotal" in text["facts.txt"] and "/dev/shm" in text["facts.txt"]
    assert " passed" in text["cuda-tests.log"] and "failed" not in text["cuda-tests.log"]
    for case in ("dense", "dilated", "block_sparse", "ring", "ring_dilated", "ring_block_sparse"):
        assert f"| {case} | ok | yes |" in text["protocol.log"]
    assert "| deliberate oom | oom | yes |" in text["protocol.log"]
    engine, report = text["engine.log"], text["engine-report.md"]
    assert "database at revision" in engine and "Started a local Ray instance" in engine
    for sweep in range(1, 6):
        assert f"sweep {sweep} ended: succeeded" in engine and f"# sweep {sweep}\n" in report
    assert "dilated: max " in engine and "tokens" in engine  # the budgeted search found one
    bench = text["bench-gpu.md"]
    assert "## results.md" in bench
    assert "| sdpa | 128 |" in bench and "| ring_dilated | 128 |" in bench  # timed rows


def _plan_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "device_plan", ROOT / "scripts" / "device_plan.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_plan_predicts_the_gpu_check_within_its_budget() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGLAB_", "DEVICE_CHECK"))}
    env["DEVICE_CHECK_PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--plan"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    steps = re.findall(r"^## (\S+): predicted (\d+) s \(timeout (\d+) s", out, re.M)
    assert [s[0] for s in steps] == [
        "facts", "install", "cuda-tests", "protocol", "engine", "report", "bench"
    ]  # fmt: skip
    assert all(int(predicted) <= int(cap) for _, predicted, cap in steps)
    (total,) = re.findall(r"^total predicted (\d+) s of the 530 s budget", out, re.M)
    assert int(total) == pytest.approx(sum(int(s[1]) for s in steps), abs=len(steps))
    assert int(total) <= 530
    # every cell with its FLOPs, compilations and seconds; the deliberate OOMs compute nothing.
    # train at 64K: its forward graph with grad and that graph's backward (the forward cell
    # before it checked and ran under no_grad, so it shares none of them)
    assert re.search(
        r"^\| block_sparse train 65536 bfloat16 \| [\d.]+ \| 2 \| [\d.]+ \|$", out, re.M
    )
    assert re.search(r"^\| deliberate oom \| 0 \| 0 \| 0\.0 \|$", out, re.M)
    assert len(re.findall(r"^\| test_cuda oom \| 0 \| 0 \| 0\.0 \|$", out, re.M)) == 2
    assert "- bfloat16 = 4e+14: bf16 flash attention achieved on an H100" in out


def test_the_plan_names_a_step_over_its_timeout_or_recompile_limit_and_the_total() -> None:
    plan = _plan_module()
    limit = plan.recompile_limit()
    steps = [
        plan.Step("engine", 300, 320.0, [], [3, 2]),
        plan.Step("bench", 240, 10.0, [], [limit + 1], ["its searches"]),
    ]
    text, problems = plan.render(steps, 300)
    assert problems == [
        "step engine: predicted 320 s is over its timeout of 300 s",
        "step bench: not predicted: its searches",
        f"step bench: a process compiles {limit + 1} entries, over the compiled kernels' "
        f"recompile limit of {limit}",
        "predicted 330 s is over the 300 s budget",
    ]
    assert "total predicted 330 s of the 300 s budget" in text
