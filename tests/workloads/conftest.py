"""Fixtures for the workloads tests: a job's directories and a cluster of torchrun nodes that is always cleaned up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workloads.harness import Cluster, JobDirs


@pytest.fixture
def job(tmp_path: Path) -> JobDirs:
    return JobDirs(tmp_path / "job")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Nodes started by the test; their logs are printed at teardown (pytest shows them when the test failed)."""
    cluster = Cluster(tmp_path)
    yield cluster
    cluster.stop_all()
    print(cluster.logs())
