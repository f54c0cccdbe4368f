"""/api/v1/cluster: Ray nodes, their CPUs and GPUs, and what is free now."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api import ray_link
from service.api.deps import SessionDep, require_read
from service.api.schemas import ClusterOut, Message
from service.db.models import Run, RunStatus
from workers import cluster
from workers.config import RunConfig

router = APIRouter(prefix="/cluster", tags=["cluster"], dependencies=[Depends(require_read)])


@router.get("", responses={503: {"model": Message, "description": "No Ray cluster reachable."}})
def get_cluster(request: Request, session: SessionDep) -> ClusterOut:
    """The cluster as workers.cluster.describe() saw it at the Ray driver's last report, a
    second ago at most (503 when Ray is unreachable), with
    what warm gangs hold while they run nothing (a gang stays up for the next run)."""
    problem = ray_link.problem(request.app.state)
    info = ray_link.cluster_info(request.app.state)
    if problem is not None or info is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"ray: {problem}")
    busy_cpus, busy_gpus = _running_ranks(session, info)
    return ClusterOut.model_validate(
        {
            **info,
            "idle_gang_cpus": max(0.0, info["gang_cpus"] - busy_cpus),
            "idle_gang_gpus": max(0.0, info["gang_gpus"] - busy_gpus),
        }
    )


def _running_ranks(session: Session, info: dict[str, Any]) -> tuple[float, float]:
    """CPUs and GPUs the running runs' ranks hold (one bundle per rank, by device)."""
    cpus = gpus = 0.0
    for run in session.scalars(select(Run).where(Run.status == RunStatus.running)):
        kind = cluster.device_kind(RunConfig.model_validate(run.config), info)
        if kind == "cuda":
            gpus += run.world_size
        else:
            cpus += run.world_size
    return cpus, gpus
