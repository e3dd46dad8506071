"""Testbed tests build real namespaces: they need root and iproute2, skip with the reason otherwise, and fail under
`CI=1` (CI's machines have both). Every testbed a test builds is removed by its cloud id afterwards."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator

import pytest

from provider_agents.testbed.netns import remove, unavailable


@pytest.fixture(scope="session")
def testbed_possible() -> None:
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: CI must be able to build the testbed")
        pytest.skip(reason)


@pytest.fixture
def new_cloud(testbed_possible: None) -> Iterator[Callable[[], str]]:
    """Makes fresh cloud ids for the test; each one's namespaces are removed afterwards, whatever happened."""
    made: list[str] = []

    def new() -> str:
        made.append(secrets.token_hex(6))
        return made[-1]

    yield new
    for cloud in made:
        remove(cloud)
