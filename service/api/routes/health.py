"""/api/v1/healthz (the process answers) and /api/v1/readyz (database and Ray reachable)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from service.api import ray_link
from service.api.schemas import HealthOut

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> HealthOut:
    """Liveness: the process serves requests (no dependency is checked). Async: it answers from
    the event loop, whatever holds the thread pool."""
    return HealthOut(status="ok")


def _database(request: Request) -> str | None:
    try:
        with request.app.state.sessionmaker() as session:
            session.execute(select(1))
    except SQLAlchemyError as e:
        return f"unreachable: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def _scheduler(request: Request) -> str:
    state = request.app.state
    thread = getattr(state, "scheduler_thread", None)
    if thread is None:
        return "not embedded"  # informational: `ringlab scheduler` may run elsewhere
    if not thread.is_alive():
        return f"stopped: {state.scheduler_error or 'exited'}"
    return "running"


@router.get(
    "/readyz",
    response_model=HealthOut,
    responses={503: {"model": HealthOut, "description": "A dependency is unreachable."}},
)
def readyz(request: Request) -> HealthOut | JSONResponse:
    """Readiness: the database answers and this process is connected to a live Ray cluster."""
    db_problem = _database(request)
    ray_problem = ray_link.problem(request.app.state)
    scheduler = _scheduler(request)
    checks = {
        "database": db_problem or "ok",
        "ray": ray_problem or "ok",
        "scheduler": scheduler,
    }
    if db_problem or ray_problem or scheduler.startswith("stopped"):
        return JSONResponse(
            HealthOut(status="unavailable", checks=checks).model_dump(), status_code=503
        )
    return HealthOut(status="ok", checks=checks)
