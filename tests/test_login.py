"""With RINGLAB_REQUIRE_TOKEN_FOR_READS the dashboard asks for the token once and keeps a
session cookie (HttpOnly, SameSite=Strict, Secure over https) that admits reads, never writes."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

from _api_helpers import TOKEN, api_client, small_spec

from service.api.deps import SESSION_COOKIE

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

        assert client.get(f"/sweeps/{sweep_id}").status_code == 200  # the client keeps it
        assert client.get(f"{API}/sweeps").status_code == 200
        with client.stream("GET", f"{API}/sweeps/{sweep_id}/events") as events:
            assert events.status_code == 200  # EventSource sends the cookie too
        assert client.post(f"{API}/sweeps", json=small_spec(name="w")).status_code == 401

        out = client.post("/logout", follow_redirects=False)
        assert out.status_code == 303 and f"{SESSION_COOKIE}=" in out.headers["set-cookie"]
        client.cookies.clear()
        assert client.get("/", follow_redirects=False).status_code == 303


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
