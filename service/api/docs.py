"""The API's own description: /openapi.json, and Swagger UI (5.x: it reads OpenAPI 3.1) at /docs
from the files the fastapi-offline package ships (the app's CSP blocks any CDN, and clusters are
often offline). Both sit behind
the read check: with reads locked they need the token, or a dashboard login.

The schema says what each operation really asks for: without RINGLAB_API_TOKEN nothing needs a
token (`security: []`); with one, writes need the bearer token, and reads only when they are
locked. An operation that needs no token documents no 401."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from service.api.deps import require_read, require_read_page
from service.api.security import NONCE_KEY
from service.core.config import Settings

ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSET_TYPES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}
SAFE_METHODS = {"get", "head", "options"}

router = APIRouter(include_in_schema=False)

THROTTLED = {
    "description": "Too many wrong tokens from this address (limits.FailureThrottle); see "
    "Retry-After.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Message"}}},
}


def _needs_token(settings: Settings, method: str) -> bool:
    """Whether an operation with the auth check behind `method` asks for the bearer token."""
    if settings.api_token is None:
        return False
    return method not in SAFE_METHODS or settings.require_token_for_reads


def openapi_schema(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The app's OpenAPI schema with each operation's security as `settings` enforce it."""
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    for operations in schema.get("paths", {}).values():
        for method, operation in operations.items():
            if "security" not in operation:  # no auth check at all (health)
                continue
            if not _needs_token(settings, method):
                operation["security"] = []
                operation.get("responses", {}).pop("401", None)
            else:
                operation.setdefault("responses", {}).setdefault("429", THROTTLED)
    return schema


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make app.openapi() build (once) the schema openapi_schema describes."""

    def cached() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, settings)
        return app.openapi_schema

    app.openapi = cached  # type: ignore[method-assign]


@router.get("/openapi.json", dependencies=[Depends(require_read)])
def openapi_json(request: Request) -> JSONResponse:
    """The OpenAPI schema."""
    return JSONResponse(request.app.openapi())


PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>ringlab API</title>
  <link rel="icon" href="data:,">
  <link rel="stylesheet" href="/docs/assets/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/assets/swagger-ui-bundle.js"></script>
  <script nonce="{nonce}">
    window.ui = SwaggerUIBundle({{url: "/openapi.json", dom_id: "#swagger-ui",
      validatorUrl: null, deepLinking: true}});
  </script>
</body>
</html>
"""


@router.get("/docs", dependencies=[Depends(require_read_page)])
def docs_page(request: Request) -> HTMLResponse:
    """Swagger UI over /openapi.json; its one inline call carries the request's nonce."""
    return HTMLResponse(PAGE.format(nonce=getattr(request.state, NONCE_KEY)))


@router.get("/docs/assets/{name}")
def docs_asset(name: str) -> FileResponse:
    """Swagger UI's script and style sheet from the installed package (a fixed list)."""
    if name not in ASSET_TYPES:
        raise HTTPException(404, f"no file {name!r}")
    return FileResponse(ASSETS / name, media_type=ASSET_TYPES[name])
