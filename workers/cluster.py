"""The Ray cluster as the engine sees it: connect, describe, and check a run can ever be placed.

A STRICT_SPREAD group that cannot be placed never becomes ready and raises nothing, so every
run is checked here before its placement group is created.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray._private.state import available_resources_per_node
from ray.util.placement_group import placement_group_table

from workers import fit, local_ray
from workers.fit import DeviceKind, bundle

KNOWN_RAY_NOTICES = (
    # ringlab connects from a scheduler thread and handles SIGTERM itself (service/cli.py)
    "SIGTERM handler is not set because current thread is not the main thread",
    # the local head ringlab starts uses Ray's default token auth, as it should
    "Token authentication is enabled for this Ray cluster",
)


class _KnownNotices(logging.Filter):
    """Drops Ray's start-up notices that are expected under ringlab (KNOWN_RAY_NOTICES)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(notice in message for notice in KNOWN_RAY_NOTICES)


def quiet_known_notices() -> None:
    """Keep Ray's expected start-up notices off the console (real warnings still show)."""
    for handler in logging.getLogger("ray").handlers:
        if not any(isinstance(f, _KnownNotices) for f in handler.filters):
            handler.addFilter(_KnownNotices())


def connect(address: str | None = None) -> None:
    """Join the cluster at `address`, or start a local Ray when None and none is running."""
    if ray.is_initialized():
        return
    quiet_known_notices()
    if address is None:
        local_ray.start()  # its helper processes are killed at exit, even after a Ctrl-C
    else:
        ray.init(address=address, log_to_driver=False)


def _gpu_names(resources: dict[str, float]) -> list[str]:
    prefix = "accelerator_type:"
    return sorted(k[len(prefix) :] for k in resources if k.startswith(prefix))


GANG_GROUP_PREFIX = "ringlab-gang-"
"""Name prefix of every gang's placement group (workers.gang): what gangs hold is counted by it."""


__all__ = ["DeviceKind", "bundle", "check_feasible", "connect", "describe", "device_kind"]


def describe() -> dict[str, Any]:
    """Alive nodes (id, IP, hostname, CPUs, GPUs, GPU types, free CPUs/GPUs) and the totals."""
    free = available_resources_per_node()
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = node.get("Resources", {})
        avail = free.get(node["NodeID"], {})
        nodes.append(
            {
                "node_id": node["NodeID"],
                "ip": node["NodeManagerAddress"],
                "hostname": node.get("NodeManagerHostname", ""),
                "cpus": float(total.get("CPU", 0.0)),
                "gpus": float(total.get("GPU", 0.0)),
                "gpu_names": _gpu_names(total),
                "free_cpus": float(avail.get("CPU", 0.0)),
                "free_gpus": float(avail.get("GPU", 0.0)),
            }
        )
    nodes.sort(key=lambda n: (n["ip"], n["node_id"]))
    gang_cpus, gang_gpus = _held_by_gangs()
    return {
        "nodes": nodes,
        "total_cpus": sum(n["cpus"] for n in nodes),
        "total_gpus": sum(n["gpus"] for n in nodes),
        "free_cpus": sum(n["free_cpus"] for n in nodes),
        "free_gpus": sum(n["free_gpus"] for n in nodes),
        "gang_cpus": gang_cpus,
        "gang_gpus": gang_gpus,
    }


def _held_by_gangs() -> tuple[float, float]:
    """CPUs and GPUs reserved by ringlab's gangs (their placement groups), busy or warm."""
    cpus = gpus = 0.0
    for group in placement_group_table().values():
        if group.get("state") != "CREATED" or not group.get("name", "").startswith(
            GANG_GROUP_PREFIX
        ):
            continue
        for resources in group.get("bundles", {}).values():
            cpus += float(resources.get("CPU", 0.0))
            gpus += float(resources.get("GPU", 0.0))
    return cpus, gpus


def device_kind(config: fit.Placed, cluster: dict[str, Any] | None = None) -> DeviceKind:
    """cuda or cpu for this run (workers.fit.device_kind) on `cluster`, or on this one."""
    return fit.device_kind(config, describe() if cluster is None else cluster)


def check_feasible(config: fit.Placed, cluster: dict[str, Any] | None = None) -> None:
    """Raise Infeasible unless `cluster` (default: this one) could ever hold this run
    (workers.fit.check_feasible)."""
    fit.check_feasible(config, describe() if cluster is None else cluster)
