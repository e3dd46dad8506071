"""What a failing test reports about its broker (tests/conftest.py): whether it runs, how it ended, its log's end."""

from __future__ import annotations

import signal

from broker_config.server import NatsServer
from tests.support import eventually


async def test_describe_tells_a_running_server_from_one_that_died_and_one_its_owner_killed(
    nats_server: NatsServer,
) -> None:
    running = nats_server.describe()
    assert f"nats-server on {nats_server.url}: running (pid {nats_server.pid})" in running
    assert "Server is ready" in running, "the log's end comes with it"

    nats_server.signal(signal.SIGKILL)  # died under the test, not stopped by it
    await eventually(lambda: not nats_server.is_running(), what="the server gone")
    assert "exited with -9" in nats_server.describe()

    nats_server.stop()  # the fixture's teardown does this: it must not hide that the server had died
    assert "had exited on its own before its owner stopped it" in nats_server.describe()
    assert "exit code -9" in nats_server.describe()

    nats_server.start()
    nats_server.kill()
    assert "killed by its owner (pid" in nats_server.describe() and "exit code -9" in nats_server.describe()
