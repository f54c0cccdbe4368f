"""Fail closed, fail clearly (issue 42 item 5): security headers on every response, a 503 with
Retry-After and the reason while the database is down, and `ringlab serve` refusing to start
open where it would be exposed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _api_helpers import TOKEN, api_client, small_spec
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker
from typer.testing import CliRunner

from service.cli import app as cli_app
from service.core.config import Settings, exposure_problem, is_loopback

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2"
"""Port 1 on loopback: nothing listens, the connection is refused at once."""


def _csp_nonce(headers: dict[str, str] | object) -> str:
    csp = headers["content-security-policy"]  # type: ignore[index]
    assert "frame-ancestors 'none'" in csp and "object-src 'none'" in csp, csp
    assert "script-src 'self' 'nonce-" in csp and "unsafe-eval" not in csp, csp
    assert headers["x-content-type-options"] == "nosniff"  # type: ignore[index]
    assert headers["x-frame-options"] == "DENY"  # type: ignore[index]
    match = re.search(r"'nonce-([^']+)'", csp)
    assert match is not None
    return match.group(1)


def test_pages_and_api_answers_carry_the_security_headers(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        r = client.post("/api/v1/sweeps", json=small_spec())
        assert r.status_code == 201
        sweep = r.json()["id"]
        answers = [
            r,
            client.get("/api/v1/sweeps"),
            client.get("/"),
            client.get("/static/plotly.min.js"),
            client.get("/api/v1/sweeps/999"),
            client.post("/api/v1/sweeps", json={"name": ""}),
            client.post("/api/v1/sweeps", content=b"x" * (2 << 20)),
        ]
        assert [a.status_code for a in answers] == [201, 200, 200, 200, 404, 422, 413]
        nonces = {_csp_nonce(a.headers) for a in answers}
        assert len(nonces) == len(answers), "a nonce is never reused"

        page = client.get(f"/sweeps/{sweep}")
        nonce = _csp_nonce(page.headers)
        inline = re.findall(r"<script( [^>]*)?>(?!</script>)", page.text)
        runnable = [attrs for attrs in inline if "src=" not in attrs and "json" not in attrs]
        assert runnable == [f' nonce="{nonce}"'], runnable


def test_a_database_outage_is_a_503_with_retry_after_and_the_reason(tmp_path: Path) -> None:
    """The database goes away under a running service (its sessions now reach a port where
    nothing listens): every request that needs it answers 503 JSON, and nothing is lost."""
    with api_client(f"sqlite:///{tmp_path / 'ringlab.db'}") as client:
        assert client.post("/api/v1/sweeps", json=small_spec()).status_code == 201
        state = client.app.state  # type: ignore[attr-defined]
        working = state.sessionmaker
        dead = create_engine(UNREACHABLE, pool_pre_ping=False)
        state.sessionmaker = sessionmaker(dead)
        try:
            for r in (
                client.get("/api/v1/sweeps"),
                client.post("/api/v1/sweeps", json=small_spec("during")),
                client.get("/sweeps/1/dashboard.json"),
            ):
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "5"
                assert r.headers["content-type"] == "application/json"
                detail = r.json()["detail"]
                assert detail.startswith("database unavailable (OperationalError: "), detail
                assert "port 1 failed" in detail and detail.endswith("; retry later"), detail
            for path in ("/sweeps/1", "/", "/cells/history?run=1"):  # the dashboard: a page
                page = client.get(path)
                assert page.status_code == 503 and page.headers["retry-after"] == "5", path
                assert page.headers["content-type"].startswith("text/html"), path
                _csp_nonce(page.headers)
                reason = re.search(r'<p id="unavailable">([^<]*)</p>', page.text)
                assert reason is not None, page.text
                assert reason.group(1).startswith("database unavailable (OperationalError: ")
        finally:
            state.sessionmaker = working
            dead.dispose()
        listed = client.get("/api/v1/sweeps").json()
        assert [s["name"] for s in listed["data"]] == ["small"], listed


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
     ("10.0.0.5", False), ("example.org", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


runner = CliRunner()


def _serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str, **env: str):
    """`ringlab serve` with `env`; run_server is replaced so a start that passes returns."""
    import service.app

    started: list[str] = []
    monkeypatch.setattr(service.app, "run_server", lambda *a, **k: started.append(k["host"]))
    monkeypatch.setenv("RINGLAB_DATABASE_URL", f"sqlite:///{tmp_path / 'ringlab.db'}")
    for name in ("RINGLAB_API_TOKEN", "RINGLAB_REQUIRE_TOKEN_FOR_READS", "RINGLAB_HOST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = runner.invoke(cli_app, ["serve", "--port", "1", *args])
    return result, started


def test_serve_refuses_reads_locked_without_a_token(tmp_path, monkeypatch) -> None:
    result, started = _serve(tmp_path, monkeypatch, RINGLAB_REQUIRE_TOKEN_FOR_READS="true")
    assert result.exit_code == 1 and not started, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "RINGLAB_REQUIRE_TOKEN_FOR_READS=true needs RINGLAB_API_TOKEN" in lines[0]


def test_serve_refuses_a_public_address_without_a_token_unless_insecure(
    tmp_path, monkeypatch
) -> None:
    result, started = _serve(tmp_path, monkeypatch, "--host", "0.0.0.0")
    assert result.exit_code == 1 and not started, result.output
    assert "refusing to serve on 0.0.0.0 without RINGLAB_API_TOKEN" in result.output
    assert "--insecure" in result.output
    settings = Settings(database_url="sqlite:///x.db", api_token=TOKEN)
    assert exposure_problem(settings, "0.0.0.0") is None
    assert (
        exposure_problem(Settings(database_url="sqlite:///x.db"), "0.0.0.0", insecure=True) is None
    )
    assert exposure_problem(Settings(database_url="sqlite:///x.db"), "127.0.0.1") is None


def test_an_unanswered_exception_is_a_500_with_the_headers_and_a_request_id_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug no handler answers: JSON naming the request id (the same as X-Request-ID), the
    security headers, and one log line naming the request with its traceback."""
    from fastapi import APIRouter
    from fastapi.testclient import TestClient

    from service.app import create_app

    broken = APIRouter()

    @broken.get("/broken")
    def _broken() -> None:
        raise RuntimeError("a bug")

    app = create_app(
        Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}"), extra_routers=[broken]
    )
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as client:
        r = client.get("/broken")
        given = client.get("/broken", headers={"X-Request-ID": "abc-123"})
        ok = client.get("/api/v1/healthz")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    _csp_nonce(r.headers)
    request_id = r.headers["x-request-id"]
    assert r.json() == {
        "detail": f"internal error; the server's log names request {request_id}",
        "request_id": request_id,
    }
    assert given.json()["request_id"] == "abc-123"
    assert ok.headers["x-request-id"] and ok.headers["x-request-id"] != request_id
    lines = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert [rec.getMessage() for rec in lines] == [f"500 for GET /broken (request {request_id})"]
    assert lines[0].exc_info is not None and "a bug" in str(lines[0].exc_info[1])


def test_credentials_make_an_answer_uncacheable(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 'r.db'}", api_token=TOKEN) as client:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/api/v1/sweeps", headers=bearer).headers["cache-control"] == "no-store"
        client.cookies.set("ringlab_session", "x.y")
        assert client.get("/").headers["cache-control"] == "no-store"
        assert "no-store" not in client.get("/static/app.js").headers.get("cache-control", "")
        client.cookies.clear()
        assert "cache-control" not in client.get("/api/v1/sweeps").headers
