"""The web console: static pages (HTML, JavaScript modules, CSS; no build step) served under `/console/`.

The pages hold no data and no privilege of their own: they call the same REST API as everyone else with the token
the user pastes (kept in the tab's sessionStorage), so the API's own authorization decides what each token can read.
A tenant's token shows that tenant's jobs, negotiations and live events; the admin token adds the provider's hosts,
ledger utilisation and outbox.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
MOUNT_PATH: Final = "/console"
SECURITY_HEADERS: Final = {
    # The page holds an API token: only our own scripts may run, nothing may frame it, no URL leaks as a referrer.
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


class _ConsoleFiles(StaticFiles):
    """The console's files, each with the security headers above."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def install_console(app: FastAPI) -> None:
    """Serve the console's files at `/console/` (and send `/console` there)."""

    @app.get(MOUNT_PATH, include_in_schema=False)
    async def _console_root() -> RedirectResponse:
        return RedirectResponse(f"{MOUNT_PATH}/")

    app.mount(MOUNT_PATH, _ConsoleFiles(directory=STATIC_DIR, html=True), name="console")
