"""A hostile page cannot act through a visitor's browser: a state-changing request from another
site is 403 and a Host header that is not this server's is 400 (DNS rebinding), in every mode,
the open one included; the CLI, curl and the dashboard's own forms keep working."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from _api_helpers import small_spec
from _web_helpers import live_server, make_web_app

from service.core.config import Settings, allowed_host_names

EVIL = "http://evil.example"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _curl_post(url: str, *headers: str) -> int:
    """The status curl gets for a bodiless form POST with `headers` (what a page could send)."""
    args = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", url]
    for header in headers:
        args += ["-H", header]
    return int(subprocess.run(args, capture_output=True, text=True, check=True).stdout)


def test_a_cross_site_write_is_403_and_changes_nothing(database_url: str) -> None:
    app = make_web_app(Settings(database_url=database_url))  # open: no token
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        created = http.post("/api/v1/sweeps", json=small_spec())  # no browser signal: the CLI
        assert created.status_code == 201, created.text
        sweep = created.json()["id"]
        for action in ("cancel", "retry"):
            url = f"{base}/api/v1/sweeps/{sweep}/{action}"
            content_type = "Content-Type: application/x-www-form-urlencoded"
            assert _curl_post(url, f"Origin: {EVIL}", content_type) == 403, action
            assert _curl_post(url, "Sec-Fetch-Site: cross-site", content_type) == 403, action
            assert _curl_post(url, "Sec-Fetch-Site: same-site", content_type) == 403, action
            assert _curl_post(url, "Origin: null", content_type) == 403, action
        refused = http.post(f"/api/v1/sweeps/{sweep}/cancel", headers={"Origin": EVIL, **FORM})
        assert refused.json()["detail"].startswith("cross-site request refused: Origin "), refused
        assert "content-security-policy" in refused.headers  # SiteGuard sits inside the headers
        deleted = http.delete(f"/api/v1/sweeps/{sweep}", headers={"Origin": EVIL})
        assert deleted.status_code == 403
        counts = http.get(f"/api/v1/sweeps/{sweep}").json()["counts"]
        assert counts["queued"] == 4 and counts["cancelled"] == 0, counts  # nothing changed
        # the same site's own requests (what a browser on the dashboard sends) go through
        same = http.post(f"/api/v1/sweeps/{sweep}/cancel", headers={"Origin": base, **FORM})
        assert same.status_code == 200, same.text
        again = http.post(f"/api/v1/sweeps/{sweep}/retry?include_cancelled=true",
                          headers={"Sec-Fetch-Site": "same-origin"})  # fmt: skip
        assert again.status_code == 200, again.text
        assert http.get(f"/api/v1/sweeps/{sweep}").json()["counts"]["queued"] == 4
        # a cross-site read is harmless (the same-origin policy hides its answer): served
        assert http.get("/api/v1/sweeps", headers={"Origin": EVIL}).status_code == 200


def test_a_foreign_host_is_400_and_a_known_one_is_served(tmp_path: Path) -> None:
    app = make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'ringlab.db'}"))
    with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        port = base.rsplit(":", 1)[1]
        for path in ("/", "/api/v1/sweeps", "/api/v1/healthz"):
            foreign = http.get(path, headers={"Host": f"attacker.example:{port}"})
            assert foreign.status_code == 400, (path, foreign.text)
            assert "RINGLAB_ALLOWED_HOSTS" in foreign.json()["detail"]
            assert foreign.headers["x-frame-options"] == "DENY"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):
            assert http.get("/api/v1/sweeps", headers={"Host": host}).status_code == 200, host
        post = http.post("/api/v1/sweeps", json=small_spec(), headers={"Host": "evil.example"})
        assert post.status_code == 400


def test_allowed_hosts_follow_the_bind_and_the_setting() -> None:
    loopback = allowed_host_names(Settings())
    assert loopback == {"localhost", "127.0.0.1", "::1"}
    named = allowed_host_names(Settings(host="10.1.2.3"))
    assert named is not None and "10.1.2.3" in named and "localhost" in named
    wildcard = allowed_host_names(Settings(host="0.0.0.0"))
    import socket

    assert wildcard is not None and socket.gethostname().lower() in wildcard
    listed = allowed_host_names(Settings(allowed_hosts=" Lab.Example , [::2] ,"))
    assert listed == {"lab.example", "::2"}
    assert allowed_host_names(Settings(allowed_hosts="*")) is None


@pytest.mark.parametrize("hosts", ["lab.example", "*"])
def test_ringlab_allowed_hosts_admits_a_name(tmp_path: Path, hosts: str) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}", allowed_hosts=hosts)
    with live_server(make_web_app(settings)) as base, httpx.Client(base_url=base) as http:
        assert http.get("/api/v1/sweeps", headers={"Host": "lab.example"}).status_code == 200
        elsewhere = http.get("/api/v1/sweeps", headers={"Host": "other.example"}).status_code
        assert elsewhere == (200 if hosts == "*" else 400)
