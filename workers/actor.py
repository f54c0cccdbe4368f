"""One rank of a gang: a Ray actor that joins the process group and runs benchmark cases.

The actor sets its CUDA device from Ray's GPU assignment before CUDA initializes, opens or
joins the rendezvous store, and runs `protocol.run_case`, returning a CaseOutcome (it never
touches the database).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import ray

from workers.config import RunConfig
from workers.errors import error_text
from workers.results import CaseOutcome

PORT_ATTEMPTS = 8


def free_port() -> int:
    """A port free on this node right now (closed again: the store may still race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _addr_in_use(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or "eaddrinuse" in text


class RankActor:
    """A process hosting one rank; wrapped by ray.remote in gang.py with the run's resources."""

    def __init__(self) -> None:
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        if gpu_ids:
            # Before torch touches CUDA: the only devices this rank may see are Ray's.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        self.gpu_ids = gpu_ids
        self._store: Any = None
        self._rank: int | None = None

    def info(self) -> dict[str, Any]:
        """Node, process and GPUs of this actor, and the NCCL_* variables it runs with.

        Also imports torch and the protocol, so every rank pays that cost at once, in parallel.
        """
        # The workloads load in the rank's process only: the scheduler imports this module.
        import workers.protocol  # noqa: F401

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": self.gpu_ids,
            "env_vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        }

    def open_store(self, world_size: int, timeout_s: float) -> int:
        """Rank 0: bind the rendezvous store on a free port, retrying on EADDRINUSE; the port."""
        import torch.distributed as dist  # torch.distributed: the rank's process only

        host = ray.util.get_node_ip_address()
        last: BaseException | None = None
        for _ in range(PORT_ATTEMPTS):
            port = free_port()
            try:
                self._store = dist.TCPStore(
                    host,
                    port,
                    world_size,
                    is_master=True,
                    timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False,
                )
            except (RuntimeError, OSError) as exc:
                if not _addr_in_use(exc):
                    raise
                last = exc
                continue
            return port
        raise RuntimeError(f"no free port for the store in {PORT_ATTEMPTS} tries: {last}")

    def init_dist(
        self, rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float
    ) -> None:
        """Join the process group as `rank` (nccl on CUDA, gloo on CPU) with a short timeout."""
        import torch  # rank process only: the driver side of the actor needs no torch
        import torch.distributed as dist  # torch.distributed: the rank's process only

        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(0)
        if rank != 0:
            self._store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        elif self._store is None:
            raise RuntimeError("rank 0 must open the store (open_store) before init_dist")
        dist.init_process_group(
            backend, store=self._store, rank=rank, world_size=world_size, timeout=timeout
        )
        self._rank = rank

    def run_case(self, config_json: str, kind: str) -> CaseOutcome:
        """Run one case as this rank; any error comes back as status `failed` with its cause."""
        from workers import protocol  # the rank's process only (see info)

        config = RunConfig.model_validate_json(config_json)
        rank = 0 if self._rank is None else self._rank
        try:
            return protocol.run_case(config, rank=rank, kind=kind)
        except Exception as exc:  # before the case knew its environment (run_case keeps it)
            return CaseOutcome(
                rank=rank, seq_len=config.seq_len, status="failed", error=error_text(exc)
            )

    def ping(self) -> int:
        """This actor's pid: proves it is alive."""
        return os.getpid()
