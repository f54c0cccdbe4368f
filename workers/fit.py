"""Whether a run can ever fit a cluster, from the cluster's description alone: no Ray, no torch,
so the CLI can warn at submit with the same check the scheduler refuses a run by.

`cluster` is what workers.cluster.describe() returns (and /api/v1/cluster serves): its nodes
with their CPUs and GPUs, and the totals.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from workers.errors import Infeasible

DeviceKind = Literal["cuda", "cpu"]


class Placed(Protocol):
    """What the check reads of a run config (workers.config.RunConfig has it)."""

    @property
    def device(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def placement(self) -> str: ...


def device_kind(config: Placed, cluster: dict[str, Any]) -> DeviceKind:
    """cuda or cpu for this run: as configured, `auto` meaning cuda when the cluster has GPUs."""
    if config.device in ("cuda", "cpu"):
        return "cuda" if config.device == "cuda" else "cpu"
    return "cuda" if cluster["total_gpus"] >= 1 else "cpu"


def bundle(kind: DeviceKind) -> dict[str, float]:
    """One rank's reservation: a GPU on CUDA runs, a CPU on CPU runs."""
    return {"GPU": 1.0} if kind == "cuda" else {"CPU": 1.0}


def check_feasible(config: Placed, cluster: dict[str, Any]) -> None:
    """Raise Infeasible unless the cluster could ever hold this run's W bundles.

    W GPUs in total for a CUDA run, W CPUs for a CPU run; STRICT_SPREAD needs W distinct nodes
    with one each; every bundle needs one node that can hold it.
    """
    kind = device_kind(config, cluster)
    resource, unit = ("gpus", "GPU") if kind == "cuda" else ("cpus", "CPU")
    world = config.world_size
    nodes = cluster["nodes"]
    per_node = ", ".join(f"{n['ip']}: {n[resource]:g} {unit}" for n in nodes) or "no alive nodes"
    total = cluster[f"total_{resource}"]
    have = f"{total:g} {unit} in total on {len(nodes)} node(s) ({per_node})"
    if config.placement == "strict_spread":
        holders = sum(1 for n in nodes if n[resource] >= 1)
        if holders < world:
            raise Infeasible(
                f"{world} distinct nodes with >= 1 {unit} each "
                f"(world_size={world}, placement=strict_spread, device={kind})",
                f"{holders} node(s) with a {unit}: {have}",
            )
        return
    if total < world:
        raise Infeasible(
            f"{world} {unit} (world_size={world}, one {unit} per rank, device={kind})", have
        )
