"""Fixtures for the security suite: the API test fixtures (tests/api/conftest.py), on SQLite unless a test asks.

The guarantees here are about the API's edges (authentication, validation, limits), which do not depend on the
database, so one backend keeps the suite fast; a test that does depend on it (values the database cannot store)
parametrises `backend` itself.
"""

from __future__ import annotations

import pytest

from tests.api.conftest import (  # noqa: F401  (fixtures, re-exported for this directory)
    acme,
    app,
    broker,
    client,
    clock,
    globex,
    migrated_settings,
    negotiation_options,
    postgres_migrated,
    postgres_server,
    sqlite_template,
)


@pytest.fixture
def backend() -> str:
    return "sqlite"
