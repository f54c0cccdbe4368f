"""/docs is Swagger UI served from the fastapi-offline package's files: it renders in a real
headless chromium under the app's own CSP with nothing fetched from outside; with reads locked, the
schema and the docs need the token or a dashboard login like every other read."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from _api_helpers import TOKEN, api_client
from _web_helpers import live_server, make_web_app
from test_web_browser import CHROMIUM, CHROMIUM_ARGS, Page

from service.core.config import Settings

API_OPERATIONS = 23
"""Operations the schema lists (GET /api/v1/sweeps, POST /api/v1/sweeps, ...)."""


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is missing")
@pytest.mark.parametrize("locked", [False, True])
def test_the_api_docs_render_under_the_csp(tmp_path: Path, locked: bool) -> None:
    from playwright.sync_api import sync_playwright

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'r.db'}",
        api_token=TOKEN if locked else None,
        require_token_for_reads=locked,
    )
    with live_server(make_web_app(settings)) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = Page(browser, base)
        try:
            if locked:  # the docs send a browser to the login, which brings it back
                page.page.goto(f"{base}/docs", wait_until="networkidle")
                assert "/login?next=%2Fdocs" in page.page.url, page.page.url
                page.page.fill("input[name=token]", TOKEN)
                page.page.click("button[type=submit]")
                page.page.wait_for_url(f"{base}/docs")
            else:
                page.open("/docs")
            docs = page.page
            docs.wait_for_selector(".opblock", timeout=15_000)
            assert docs.locator(".opblock").count() == API_OPERATIONS
            assert "ringlab" in docs.locator(".info .title").inner_text()
            assert page.problems == [], page.problems  # a CSP refusal is a console error
            assert page.outside == [], page.outside
        finally:
            page.close()
            browser.close()


def test_reads_locked_covers_the_schema_and_the_docs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with api_client(url, api_token=TOKEN, require_token_for_reads=True) as client:
        schema = client.get("/openapi.json")
        assert schema.status_code == 401 and schema.headers["www-authenticate"] == "Bearer"
        docs = client.get("/docs", follow_redirects=False)
        assert docs.status_code == 303 and docs.headers["location"] == "/login?next=%2Fdocs"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/openapi.json", headers=bearer).json()["info"]["title"] == "ringlab"
        assert client.get("/docs", headers=bearer).status_code == 200
        # Swagger UI's own code is no data: reachable before logging in, like /static
        assert client.get("/docs/assets/swagger-ui-bundle.js").status_code == 200
        assert client.get("/docs/assets/index.html").status_code == 404
        assert client.get("/redoc").status_code != 200  # the CDN page is gone


def test_the_schema_declares_the_token_where_it_is_checked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"

    def security(**settings: object) -> dict[str, object]:
        app = make_web_app(Settings(database_url=url, **settings))  # type: ignore[arg-type]
        paths = app.openapi()["paths"]
        return {
            f"{m.upper()} {p}": op.get("security")
            for p, ops in paths.items()
            for m, op in ops.items()
        }

    bearer = [{"HTTPBearer": []}]
    open_ = security()
    assert open_["POST /api/v1/sweeps"] == [] and open_["GET /api/v1/runs"] == []
    token = security(api_token=TOKEN)
    assert token["POST /api/v1/sweeps"] == bearer and token["GET /api/v1/runs"] == []
    locked = security(api_token=TOKEN, require_token_for_reads=True)
    assert locked["POST /api/v1/sweeps"] == bearer and locked["GET /api/v1/runs"] == bearer
    assert locked["GET /api/v1/healthz"] is None  # never checked


def test_the_docs_assets_come_from_the_package(tmp_path: Path) -> None:
    with live_server(make_web_app(Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}"))) as base:
        js = httpx.get(f"{base}/docs/assets/swagger-ui-bundle.js")
    import fastapi_offline

    shipped = Path(fastapi_offline.__file__).parent / "static" / "swagger-ui-bundle.js"
    assert js.status_code == 200 and js.content == shipped.read_bytes()
    assert js.headers["content-type"].startswith("text/javascript")
