"""With RINGLAB_REQUIRE_TOKEN_FOR_READS the dashboard asks for the token once and keeps a
session cookie (HttpOnly, SameSite=Strict, Secure over https) that admits reads, never writes."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote

from _api_helpers import TOKEN, api_client, small_spec
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from service.api.deps import SESSION_COOKIE
from service.db.models import WebSession, utcnow

API = "/api/v1"


def test_log_in_with_the_token_then_read_with_the_cookie(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with api_client(url, api_token=TOKEN, require_token_for_reads=True) as client:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        sweep_id = client.post(f"{API}/sweeps", json=small_spec(), headers=auth).json()["id"]

        r = client.get(f"/sweeps/{sweep_id}?x=1", follow_redirects=False)
        assert r.status_code == 303
        assert unquote(r.headers["location"]) == f"/login?next=/sweeps/{sweep_id}?x=1"
        assert client.get("/static/style.css").status_code == 200  # before logging in
        assert client.get(f"{API}/sweeps").status_code == 401
        form = client.get("/login", params={"next": "/"})
        assert form.status_code == 200 and 'name="token"' in form.text

        wrong = client.post("/login", data={"token": "guess", "next": "/"}, follow_redirects=False)
        assert wrong.status_code == 401 and "not this server&#39;s token" in wrong.text
        assert SESSION_COOKIE not in wrong.headers.get("set-cookie", "")

        right = client.post(
            "/login", data={"token": TOKEN, "next": f"/sweeps/{sweep_id}"}, follow_redirects=False
        )
        assert right.status_code == 303 and right.headers["location"] == f"/sweeps/{sweep_id}"
        cookie = right.headers["set-cookie"]
        assert cookie.startswith(f"{SESSION_COOKIE}=") and TOKEN not in cookie
        attrs = {a.strip().lower() for a in cookie.split(";")}
        assert {"httponly", "samesite=strict", "path=/"} <= attrs and "secure" not in attrs
        assert f"max-age={12 * 3600}" in attrs, "the cookie expires (RINGLAB_SESSION_TTL_S)"

        assert client.get(f"/sweeps/{sweep_id}").status_code == 200  # the client keeps it
        assert client.get(f"{API}/sweeps").status_code == 200
        with client.stream("GET", f"{API}/sweeps/{sweep_id}/events") as events:
            assert events.status_code == 200  # EventSource sends the cookie too
        assert client.post(f"{API}/sweeps", json=small_spec(name="w")).status_code == 401

        out = client.post("/logout", follow_redirects=False)
        assert out.status_code == 303 and f"{SESSION_COOKIE}=" in out.headers["set-cookie"]
        client.cookies.clear()
        assert client.get("/", follow_redirects=False).status_code == 303


def _login(client: TestClient) -> str:
    r = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert r.status_code == 303
    value = r.cookies[SESSION_COOKIE]
    client.cookies.clear()
    return value


def _reads_with(client: TestClient, cookie: str) -> int:
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, cookie)
    try:
        return client.get(f"{API}/sweeps").status_code
    finally:
        client.cookies.clear()


def test_logout_revokes_the_session_on_the_server(database_url: str) -> None:
    """A copy of the cookie kept past logout (a stolen one, another tab) is refused after it:
    logging out used to delete the cookie in the browser only. Each login gets its own
    session, and logging out of one leaves the other."""
    with api_client(database_url, api_token=TOKEN, require_token_for_reads=True) as client:
        first, second = _login(client), _login(client)
        assert first != second and TOKEN not in first
        assert _reads_with(client, first) == 200 and _reads_with(client, second) == 200
        client.cookies.set(SESSION_COOKIE, first)
        assert client.post("/logout", follow_redirects=False).status_code == 303
        assert _reads_with(client, first) == 401, "the kept cookie is revoked"
        assert _reads_with(client, second) == 200, "the other session lives on"
        session_id, _, mac = second.partition(".")
        assert _reads_with(client, f"{session_id}.{'0' * len(mac)}") == 401, "forged MAC"


def test_an_expired_session_is_refused(database_url: str) -> None:
    """Past its expiry (moved there in the database: no test waits 12 hours) the cookie is
    refused even if the browser still sends it; the next login sweeps the expired row."""
    with api_client(database_url, api_token=TOKEN, require_token_for_reads=True) as client:
        cookie = _login(client)
        assert _reads_with(client, cookie) == 200
        sm = client.app.state.sessionmaker  # type: ignore[attr-defined]
        with sm() as session, session.begin():
            session.execute(update(WebSession).values(expires_at=utcnow() - timedelta(seconds=1)))
        assert _reads_with(client, cookie) == 401
        assert client.get("/", follow_redirects=False).status_code == 303
        _login(client)
        with sm() as session:
            assert session.scalar(select(func.count()).select_from(WebSession)) == 1


def test_a_forged_cookie_or_an_outside_next_goes_nowhere(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with api_client(url, api_token=TOKEN, require_token_for_reads=True) as client:
        client.cookies.set(SESSION_COOKIE, TOKEN)  # the token itself is not a session
        assert client.get(f"{API}/sweeps").status_code == 401
        client.cookies.clear()
        for outside in ("//evil.example/x", "https://evil.example", "/\\evil.example", ""):
            r = client.post(
                "/login", data={"token": TOKEN, "next": outside}, follow_redirects=False
            )
            assert r.status_code == 303 and r.headers["location"] == "/", outside


def test_the_cookie_is_secure_over_https(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with api_client(url, api_token=TOKEN, require_token_for_reads=True) as client:
        client.base_url = client.base_url.copy_with(scheme="https")
        r = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert "secure" in {a.strip().lower() for a in r.headers["set-cookie"].split(";")}


def test_without_a_read_token_login_steps_aside(tmp_path: Path) -> None:
    with api_client(f"sqlite:///{tmp_path / 'r.db'}", api_token=TOKEN) as client:
        r = client.get("/login", params={"next": "/compare"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/compare"
        assert client.get("/").status_code == 200


def test_wrong_tokens_and_logins_are_throttled_per_address(tmp_path: Path) -> None:
    """Ten wrong tokens a minute from one address; then 429 with Retry-After, even for the
    right token, until the first failure is a minute old. A request with no token guesses
    nothing and is not counted."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with api_client(url, api_token=TOKEN, require_token_for_reads=True) as client:
        for _ in range(5):
            assert client.get("/api/v1/sweeps").status_code == 401  # no token: not counted
        wrong = {"Authorization": "Bearer guess"}
        for i in range(5):
            assert client.post("/api/v1/sweeps", json={}, headers=wrong).status_code == 401
            assert client.post("/login", data={"token": f"guess{i}"}).status_code == 401
        right = {"Authorization": f"Bearer {TOKEN}"}
        for answer in (
            client.get("/api/v1/sweeps", headers=right),
            client.post("/api/v1/sweeps/1/cancel", headers=wrong),
        ):
            assert answer.status_code == 429, answer.text
            assert 55 <= int(answer.headers["retry-after"]) <= 60
            assert answer.json()["detail"].startswith("too many wrong tokens or logins from ")
        login = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert login.status_code == 429 and "ringlab_session" not in login.cookies
        assert "Too many wrong tokens or logins from " in login.text
        assert int(login.headers["retry-after"]) <= 60


def test_a_throttled_address_may_try_again_once_its_failures_age_out() -> None:
    from service.api.limits import FailureThrottle

    throttle = FailureThrottle(limit=3, window_s=0.5)
    for _ in range(3):
        assert throttle.retry_after_s("10.0.0.1") is None
        throttle.failed("10.0.0.1")
    assert throttle.retry_after_s("10.0.0.1") == 1  # whole seconds, at least one
    assert throttle.retry_after_s("10.0.0.2") is None  # per address
    time.sleep(0.6)
    assert throttle.retry_after_s("10.0.0.1") is None and throttle.failures == {}
