"""/api/v1/cluster: Ray nodes, their CPUs and GPUs, and what is free now."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, status

from service.api import ray_link
from service.api.deps import SettingsDep, require_read
from service.api.schemas import ClusterOut, Message
from workers import cluster

router = APIRouter(prefix="/cluster", tags=["cluster"], dependencies=[Depends(require_read)])


@router.get("", responses={503: {"model": Message, "description": "No Ray cluster reachable."}})
def get_cluster(request: Request, settings: SettingsDep) -> ClusterOut:
    """The cluster as workers.cluster.describe() sees it (503 when Ray is unreachable)."""
    embedded = request.app.state.scheduler_thread is not None
    problem = ray_link.problem(settings, may_connect=not embedded)
    if problem is not None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"ray: {problem}")
    return ClusterOut.model_validate(cluster.describe())
