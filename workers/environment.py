"""What a rank runs on: host, GPUs, driver, CUDA, torch, NCCL, ray, python, the git state and
the kernel plugins installed. `device_facts` needs torch alone (bench.gpu records it on GPU
machines without the service's packages)."""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attention import plugins

if TYPE_CHECKING:
    from workers.results import EnvironmentInfo

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


@functools.cache
def git_state(root: Path = PROJECT_ROOT) -> tuple[str | None, bool | None]:
    """(sha, dirty) of the project checkout; (None, None) when it is not a git checkout."""
    sha = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if sha is None:
        return None, None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return sha, bool(status) if status is not None else None


@functools.cache
def _driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _gpus(devices: list[int]) -> list[dict[str, object]]:
    gpus: list[dict[str, object]] = []
    for index in devices:
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {"name": props.name, "memory_bytes": int(props.total_memory), "uuid": str(props.uuid)}
        )
    return gpus


def device_facts(device: torch.device) -> dict[str, Any]:
    """The device's facts from the real device: GPUs (name, memory, uuid), driver, CUDA, torch
    and NCCL versions, host, python and the process' torch CPU threads; GPU fields None or empty
    off CUDA."""
    on_cuda = device.type == "cuda"
    nccl = None
    if on_cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    return {
        "hosts": [socket.gethostname()],
        "gpus": _gpus([device.index or 0]) if on_cuda else [],
        "driver": _driver_version() if on_cuda else None,
        "cuda": torch.version.cuda if on_cuda else None,
        "torch": torch.__version__,
        "nccl": nccl,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
    }


def collect(device: torch.device) -> EnvironmentInfo:
    """This process' environment; GPU fields are filled when it runs on CUDA."""
    from workers.results import EnvironmentInfo

    try:
        import ray

        ray_version: str | None = ray.__version__
    except ImportError:
        ray_version = None
    sha, dirty = git_state()
    return EnvironmentInfo(
        **device_facts(device),
        ray=ray_version,
        git_sha=sha,
        git_dirty=dirty,
        plugins=plugins.versions(),
    )
