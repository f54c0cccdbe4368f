"""The device check's rehearsal (scripts/device_check.sh --cpu, issue 35): every step of the one
command a GPU machine runs, here on CPU at tiny sizes, with the venv instead of the wheelhouse.

One run of the script (one local Ray, one submission of cpu-gpu-proof.yaml); what the GPU run
alone shows (the cp312 install, CUDA, NCCL) is the device session's (docs/device.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
