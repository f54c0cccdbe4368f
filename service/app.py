"""The FastAPI application: REST API under /api/v1, migrations at start, optional scheduler thread.

`create_app` builds it (tests use it in-process); `run_server` serves it with uvicorn, whose
SIGTERM/SIGINT handling drains requests and then runs the lifespan shutdown (scheduler stop).
"""

from __future__ import annotations

import copy
import gc
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api import docs
from service.api.docs import install_openapi
from service.api.errors import DATABASE_ERRORS, http_error, validation_error
from service.api.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from service.api.routes import cells, cluster, health, kernels, runs, sweeps
from service.api.security import SecurityHeaders, ServerErrors, SiteGuard
from service.core.config import Settings, allowed_host_names
from service.db.engine import make_engine, make_sessionmaker
from service.db.migrate import upgrade
from service.ray_status import RAY, Link
from service.ray_supervisor import Supervisor as RaySupervisor
from service.results import queries
from service.web.render import database_unavailable
from service.web.router import dashboard as web_router
from service.web.router import router as web_pages

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
SCHEDULER_JOIN_TIMEOUT_S = 8.0
"""How long shutdown waits for the Ray driver to stop (its runs get a few seconds to finish,
then are requeued; a driver that does not stop is killed within ray_supervisor.STOP_WAIT_S)."""


def api_router() -> APIRouter:
    """Every /api/v1 route."""
    router = APIRouter(prefix=API_PREFIX)
    for module in (sweeps, runs, kernels, cluster, health, cells):
        router.include_router(module.router)
    return router


def _engine_kwargs(url: str) -> dict[str, int]:
    # Sync routes run in a 40-thread pool; let most of them hold a connection at once.
    if make_url(url).get_backend_name() == "sqlite":
        return {"pool_size": 10, "max_overflow": 30}
    return {"pool_size": 10, "max_overflow": 20}


def _supervise(app: FastAPI, supervisor: RaySupervisor, stop: threading.Event) -> None:
    try:
        supervisor.run(stop)
    except Exception as e:  # recorded for /readyz and logged with its traceback
        app.state.scheduler_error = f"{type(e).__name__}: {e}"
        log.exception("the Ray driver's supervisor stopped")


async def _busy(request: Request, exc: Exception) -> JSONResponse:
    """429 for a whole-sweep read while another large one runs (service.results.queries)."""
    retry = getattr(exc, "retry_after_s", 10)
    return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(retry)})


def _start_ray(
    app: FastAPI, settings: Settings, stop: threading.Event, with_scheduler: bool
) -> threading.Thread | None:
    """The thread that keeps this process' Ray driver (service.ray_supervisor), started: it
    runs the scheduler when `with_scheduler`, else it only reports the cluster at
    RINGLAB_RAY_ADDRESS (None without one: an API-only process starts no Ray)."""
    if not with_scheduler and settings.ray_address is None:
        return None
    # /readyz says what the scheduler does from the first request on, not "not started"
    RAY.set(Link("starting", settings.ray_address or "a local Ray", 0, time.time()))
    sm = app.state.sessionmaker if with_scheduler else None
    supervisor = RaySupervisor(settings, sm, schedule=with_scheduler)
    app.state.ray_supervisor = supervisor
    thread = threading.Thread(
        target=_supervise,
        args=(app, supervisor, stop),
        name="ringlab-ray-supervisor",
        daemon=True,  # one stuck past the join timeout must not block exit
    )
    thread.start()
    return thread


def _join_scheduler(thread: threading.Thread) -> None:
    """Wait SCHEDULER_JOIN_TIMEOUT_S for the stopped supervisor; log when it did not stop."""
    thread.join(SCHEDULER_JOIN_TIMEOUT_S)
    if thread.is_alive():
        log.error(
            "the Ray driver did not stop within %.0f s; exiting anyway",
            SCHEDULER_JOIN_TIMEOUT_S,
        )


def _lifespan(
    settings: Settings, with_scheduler: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: migrate and open the engine (and start the scheduler thread when
    `with_scheduler`); at shutdown stop and join it, dispose of the engine, stop a local Ray."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        upgrade(settings.database_url)
        engine = make_engine(settings.database_url, **_engine_kwargs(settings.database_url))
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        stop = threading.Event()
        app.state.scheduler_stop = stop
        app.state.scheduler_error = None
        thread = _start_ray(app, settings, stop, with_scheduler)
        app.state.scheduler_thread = thread if with_scheduler else None
        # Start-up objects (torch, pydantic and SQLAlchemy metadata) never die: keep the cyclic
        # GC from rescanning them while a request builds tens of thousands of cells.
        gc.freeze()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                _join_scheduler(thread)
            engine.dispose()

    return lifespan


def _add_middleware_and_handlers(app: FastAPI, settings: Settings, max_body_bytes: int) -> None:
    """The body size limit, the host and cross-site checks, the 500 answer, the security
    headers and the error handlers (JSON errors)."""
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(SiteGuard, allowed_hosts=allowed_host_names(settings))
    app.add_middleware(ServerErrors)
    app.add_middleware(SecurityHeaders)  # outermost: a 400, 403, 413 or 500 has the headers
    app.add_exception_handler(queries.WholeSweepBusy, _busy)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for error in DATABASE_ERRORS:  # JSON for the API, an HTML page for the dashboard
        app.add_exception_handler(error, database_unavailable)


def create_app(
    settings: Settings | None = None,
    *,
    with_scheduler: bool = False,
    extra_routers: Iterable[APIRouter] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The ringlab API for `settings` (default: from the environment).

    At start it migrates the database and opens the engine; with_scheduler also runs the
    scheduler in a thread, stopped and joined at shutdown. The dashboard (service.web) is mounted
    at the root; `extra_routers` adds more routers there.
    """
    settings = settings or Settings()
    app = FastAPI(
        title="ringlab",
        version="0.1.0",
        summary="Sweeps of long-context attention kernels on a Ray cluster, and their results.",
        lifespan=_lifespan(settings, with_scheduler),
        openapi_url=None,  # served by service.api.docs, behind the read check
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.scheduler_thread = None
    app.state.scheduler_error = None
    app.state.ray_supervisor = None
    _add_middleware_and_handlers(app, settings, max_body_bytes)
    app.include_router(api_router())
    install_openapi(app, settings)
    app.include_router(docs.router)  # /openapi.json and /docs
    app.include_router(web_router)  # the dashboard's HTML pages at /
    for router in extra_routers:
        if router in (web_router, web_pages):  # callers from before the dashboard was built in
            continue
        app.include_router(router)
    return app


def _log_config(access_log: str) -> dict[str, Any]:
    """uvicorn's logging, its access lines written to the file `access_log`."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"] = {
        "formatter": "access",
        "class": "logging.FileHandler",
        "filename": access_log,
    }
    config["formatters"]["access"]["use_colors"] = False
    config["formatters"]["access"]["fmt"] = (
        '%(asctime)s %(client_addr)s - "%(request_line)s" %(status_code)s'
    )
    return config


def run_server(
    settings: Settings | None = None,
    host: str | None = None,
    port: int | None = None,
    with_scheduler: bool = True,
    sockets: list[socket.socket] | None = None,
    access_log: str | None = None,
) -> None:
    """Serve the API with uvicorn until SIGTERM/SIGINT, then shut down cleanly; on `sockets`
    when given (already bound and listening: the CLI takes the port before anything slow).
    With `access_log`, uvicorn's access lines go to that file instead of the terminal."""
    settings = settings or Settings()
    if host is not None and host != settings.host:  # the allowed Host names follow the bind
        settings = settings.model_copy(update={"host": host})
    app = create_app(settings, with_scheduler=with_scheduler)
    config = uvicorn.Config(
        app,
        host=host or settings.host,
        port=port or settings.port,
        log_level="info",
        timeout_graceful_shutdown=30,
        log_config=_log_config(access_log) if access_log else uvicorn.config.LOGGING_CONFIG,
    )
    server = uvicorn.Server(config)
    server.run(sockets=sockets)
    if not server.started:  # as uvicorn.run: a start-up that failed exits non-zero
        raise SystemExit(3)
