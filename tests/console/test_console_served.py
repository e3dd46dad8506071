"""What the console needs from the API without a browser: its files are served (as JavaScript modules can be loaded)
and shipped in the wheel, and the provider's views it reads (`/v1/fleet`, `/v1/outbox`) are the admin's only."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import httpx

from api.console import STATIC_DIR
from tests.console.console_cloud import ConsoleCloud

ROOT = Path(__file__).resolve().parents[2]


async def test_the_console_is_served_under_console(cloud: ConsoleCloud) -> None:
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        bare = await http.get("/console")
        assert bare.status_code in (307, 308) and bare.headers["location"].endswith("/console/")
        page = await http.get("/console/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="app.js">' in page.text
        assert "script-src" not in page.headers["content-security-policy"]  # default-src 'self': no inline script
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        for script in sorted(STATIC_DIR.glob("*.js")):
            served = await http.get(f"/console/{script.name}")
            assert served.status_code == 200, script.name
            assert "javascript" in served.headers["content-type"], (script.name, served.headers["content-type"])
        assert (await http.get("/console/style.css")).headers["content-type"].startswith("text/css")
        assert (await http.get("/console/../api/app.py")).status_code == 404


def test_every_console_file_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["api"]
    files = [path.relative_to(STATIC_DIR.parent.parent).as_posix() for path in STATIC_DIR.rglob("*") if path.is_file()]
    assert len(files) >= 8
    assert [name for name in files if not any(fnmatch(name, pattern) for pattern in patterns)] == []


async def test_the_provider_views_are_the_admins_only(cloud: ConsoleCloud) -> None:
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        for path in ("/v1/fleet", "/v1/outbox", "/v1/hosts", "/v1/allocations"):
            as_tenant = await http.get(path, headers=cloud.headers("acme"))
            assert as_tenant.status_code == 403 and "admin" in as_tenant.json()["reason"], path
            assert (await http.get(path)).status_code == 401, path
    fleet = (await cloud.admin.get("/v1/fleet")).json()
    assert (fleet["gpus_total"], fleet["gpus_allocated"], fleet["hosts_up"]) == (12, 8, 3)
    assert round(fleet["ledger_utilisation"], 3) == 0.667
    outbox = (await cloud.admin.get("/v1/outbox")).json()
    assert len(outbox) >= 2 and {m["topic"] for m in outbox} >= {"desired_state"}  # both jobs' placements
    assert [m["id"] for m in outbox] == sorted((m["id"] for m in outbox), reverse=True), "newest first"
    assert "payload" not in outbox[0]
    newest = (await cloud.admin.get("/v1/outbox", params={"limit": 1})).json()
    assert [m["id"] for m in newest] == [max(m["id"] for m in outbox)] or newest[0]["id"] > outbox[0]["id"]
    pending = (await cloud.admin.get("/v1/outbox", params={"pending": "true"})).json()
    assert all(message["delivered_at"] is None for message in pending)
