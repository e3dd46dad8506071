"""Fixtures for the web console's tests: the served cloud (`console_cloud.py`) and headless Chromium.

The browser is Debian's `chromium` driven by Playwright (its own browser download is out of reach here and in CI).
Without chromium or the playwright package the browser tests skip, saying so; under CI=1 they fail instead, because
CI installs both (`.ci/run`, the `test` extra).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from tests.console.console_cloud import ConsoleCloud, console_cloud

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


@pytest.fixture
async def cloud(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[ConsoleCloud]:
    async with console_cloud(
        tmp_path / "data", nats_url=nats_server.url, tenant_broker=tenant_broker, provider_secret=provider_secret
    ) as world:
        yield world


def _chromium() -> str:
    found = next((path for path in CHROMIUM_CANDIDATES if os.access(path, os.X_OK)), None) or shutil.which("chromium")
    if found is None:
        _missing("Debian's chromium is not installed (apt-get install chromium)")
    return str(found)


def _missing(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must install it (.ci/run)")
    pytest.skip(message)


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """A headless Chromium (Debian's), closed after the test."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _missing("the playwright package is not installed (pip install -e '.[test]')")
    executable = _chromium()
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=executable, headless=True,
                                                   args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where the browser tests save their screenshots."""
    folder = tmp_path / "screenshots"
    folder.mkdir()
    return folder
