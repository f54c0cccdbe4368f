"""What a rank runs on: host, GPUs, driver, CUDA, torch, NCCL, ray, python, the git state, the
kernel plugins installed and the node's matmul rate (workers.matmul_probe). `device_facts`
needs torch alone (bench.gpu records it on GPU machines without the service's packages)."""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

from attention import plugins
from workers.matmul_probe import node_rate
from workers.results import EnvironmentInfo

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


@functools.cache
def git_state(root: Path = PROJECT_ROOT, below: bool = False) -> tuple[str | None, bool | None]:
    """(sha, dirty) of the checkout holding `root`; (None, None) when `root` is not a tracked
    part of a git checkout (an install under site-packages, even one inside a repository's
    ignored .venv, has no code version). `below`: dirty counts only changes under `root`
    (a plugin package that lives inside a larger repository)."""
    sha = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if sha is None or not _run(["git", "ls-files", "--", "."], cwd=root):
        return None, None
    cmd = ["git", "status", "--porcelain", "--untracked-files=no"]
    status = _run([*cmd, "--", "."] if below else cmd, cwd=root)
    return sha, bool(status) if status is not None else None


def editable_source(package: str) -> Path | None:
    """The directory an editable install of `package` runs its code from (PEP 610's
    direct_url.json), None for a regular install: only there can the code running differ from
    any released version."""
    try:
        text = distribution(package).read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    if not text:
        return None
    info = json.loads(text)
    url = urlparse(info.get("url", ""))
    if url.scheme != "file" or not info.get("dir_info", {}).get("editable"):
        return None
    return Path(unquote(url.path))


def plugin_code(packages: list[str]) -> dict[str, dict[str, Any]]:
    """package -> {git_sha, git_dirty, path} for each plugin package installed editable from a
    git checkout (dirty: changes under the package's directory). ringlab's own kernels are left
    out: EnvironmentInfo.git_sha is their version."""
    found: dict[str, dict[str, Any]] = {}
    for package in packages:
        source = editable_source(package) if package != "ringlab" else None
        if source is None:
            continue
        sha, dirty = git_state(source, below=True)
        if sha is not None:
            found[package] = {"git_sha": sha, "git_dirty": dirty, "path": str(source)}
    return found


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
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
    }


def cpu_model() -> str | None:
    """The host CPU's model name from /proc/cpuinfo ('model name', or 'Model' on Arm), else
    platform.processor(); None where neither says (a CPU time is then compared blind)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()
    except OSError:  # not Linux: platform's answer below
        pass
    return platform.processor() or None


def collect(device: torch.device, dtype: torch.dtype) -> EnvironmentInfo:
    """This process' environment; GPU fields are filled when it runs on CUDA; the matmul rate
    is the node's for `device` in `dtype` (the run's), probed once per node."""
    try:
        import ray  # optional: bench scripts collect the environment where Ray is absent

        ray_version: str | None = ray.__version__
    except ImportError:
        ray_version = None
    sha, dirty = git_state()
    versions = plugins.versions()
    matmul = node_rate(device, dtype)
    return EnvironmentInfo(
        **device_facts(device),
        ray=ray_version,
        git_sha=sha,
        git_dirty=dirty,
        plugins=versions,
        plugin_code=plugin_code(list(versions)),
        matmul_dtype=matmul.dtype,
        matmul_size=matmul.size,
        matmul_s=matmul.seconds,
        matmul_flops_per_s=matmul.flops_per_s,
    )
