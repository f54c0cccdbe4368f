"""Property-based contract test: requests generated from /openapi.json get no 5xx and conform.

schemathesis runs every operation in-process (ASGI) with a bounded number of examples, on
SQLite and Postgres, against a database that holds one finished sweep; the event stream
included (every sweep is ended before its examples), and the schema's auth checked against
what the server enforces, open and with a token (ST401 ignored auth, ST203 missing header).
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from _api_helpers import TOKEN, small_spec
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    missing_required_header,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient

from service.api.limits import FailureThrottle
from service.app import create_app
from service.core.config import Settings

MAX_EXAMPLES = 20
CHECKS = [
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
    ignored_auth,
    missing_required_header,
]


def _schema(database_url: str, **settings: Any) -> tuple[Any, TestClient]:
    """The app's OpenAPI schema, loaded in-process, over a database holding one finished sweep;
    and a client on that app (its lifespan running)."""
    # schemathesis' in-process client sends Host: testserver
    hosts = "localhost,testserver"
    app = create_app(Settings(database_url=database_url, allowed_hosts=hosts, **settings))
    # the examples send wrong tokens by the hundred from one address: the throttle (10 a
    # minute, tests/service/test_login.py) would answer the rest 429, the token's too
    app.state.auth_throttle = FailureThrottle(limit=1_000_000)
    client = TestClient(app, base_url="http://localhost")
    if settings.get("api_token"):
        client.headers["Authorization"] = f"Bearer {TOKEN}"
    # starts the app's lifespan; reads the schema as a client with the token would
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app, headers=dict(client.headers))
    sweep_id = client.post("/api/v1/sweeps", json=small_spec()).json()["id"]
    assert client.post(f"/api/v1/sweeps/{sweep_id}/cancel").status_code == 200
    return loaded, client


def _end_every_sweep(client: TestClient) -> None:
    """Cancel the sweeps the examples submitted: an event stream then ends at once."""
    listed = client.get("/api/v1/sweeps", params={"limit": 500}).json()["data"]
    for sweep in listed:
        if not sweep["done"]:
            assert client.post(f"/api/v1/sweeps/{sweep['id']}/cancel").status_code == 200


def _contract(database_url: str, max_examples: int, **app_settings: Any) -> list[int]:
    """Run every operation's examples (with the token when `app_settings` set one); the
    statuses."""
    loaded, client = _schema(database_url, **app_settings)
    operations = [result.ok() for result in loaded.get_all_operations()]
    assert len(operations) >= 13
    auth = {"Authorization": f"Bearer {TOKEN}"} if app_settings.get("api_token") else {}
    statuses: list[int] = []
    for operation in operations:
        if operation.path.endswith("/events"):
            _end_every_sweep(client)

        @given(case=operation.as_strategy())
        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            response = case.call(headers={**(case.headers or {}), **auth})
            documented = case.operation.definition.raw["responses"]
            # 503 is the documented answer of /cluster and /readyz when Ray is unreachable.
            if not (response.status_code == 503 and "503" in documented):
                assert response.status_code < 500, (case.path, response.status_code, response.text)
            case.validate_response(response, checks=CHECKS)
            statuses.append(response.status_code)

        check()
    assert len(statuses) >= max_examples // 2 * len(operations)
    return statuses


@pytest.mark.timeout(240)
def test_openapi_contract(database_url: str) -> None:
    """Open (no token): the schema asks for no token anywhere, and the answers conform."""
    statuses = _contract(database_url, MAX_EXAMPLES)
    assert {200, 404, 422} <= set(statuses)  # the examples reach real answers too


@pytest.mark.timeout(240)
@pytest.mark.parametrize("locked", [False, True])
def test_openapi_contract_with_a_token(tmp_path: Any, locked: bool) -> None:
    """With RINGLAB_API_TOKEN (reads open or locked), every operation that declares the token
    refuses a request without it or with a wrong one, and one that does not serves it."""
    url = f"sqlite:///{tmp_path / 'ringlab.db'}"
    statuses = _contract(url, 8, api_token=TOKEN, require_token_for_reads=locked)
    assert {200, 404, 422} <= set(statuses)
