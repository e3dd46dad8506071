"""The address `harmonaize api serve --replicas N` serves on: held by the supervisor, one listening socket per replica.

Loopback only. What is checked: the reservation refuses an address anything holds (a plain listener, or another
cloud's port-sharing replicas, which SO_REUSEPORT alone would let us join), connections reach every replica's
socket, and none ever waits on the reservation itself (it never listens).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from harmonaize_cli.api_replicas import replica_listener, reserve_address

HOST = "127.0.0.1"


@pytest.fixture
def sockets() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_a_free_port_is_reserved_and_refuses_connections_until_a_replica_listens(sockets: ExitStack) -> None:
    reserved = sockets.enter_context(reserve_address(HOST, 0))
    address = reserved.getsockname()
    assert address[1] > 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5).close()
    listener = sockets.enter_context(replica_listener(address))
    client = sockets.enter_context(socket.create_connection(address, timeout=5))
    accepted, _ = listener.accept()
    accepted.close()
    assert client.getpeername() == address


def test_an_address_another_program_listens_on_is_refused(sockets: ExitStack) -> None:
    plain = sockets.enter_context(socket.create_server((HOST, 0)))
    with pytest.raises(OSError) as refused:
        reserve_address(HOST, plain.getsockname()[1])
    assert refused.value.errno is not None


def test_another_clouds_replicas_are_not_joined(sockets: ExitStack) -> None:
    """Port-sharing sockets of the same user would let a second supervisor share (and split) the first one's port."""
    theirs = sockets.enter_context(reserve_address(HOST, 0))
    their_replica = sockets.enter_context(replica_listener(theirs.getsockname()))
    with pytest.raises(OSError):
        reserve_address(HOST, their_replica.getsockname()[1])


def test_connections_spread_over_every_replica_socket(sockets: ExitStack) -> None:
    reserved = sockets.enter_context(reserve_address(HOST, 0))
    address = reserved.getsockname()
    listeners = [sockets.enter_context(replica_listener(address)) for _ in range(3)]
    clients = [sockets.enter_context(socket.create_connection(address, timeout=5)) for _ in range(30)]
    held = []
    for listener in listeners:
        listener.setblocking(False)
        count = 0
        while True:
            try:
                accepted, _ = listener.accept()
            except BlockingIOError:
                break
            accepted.close()
            count += 1
        held.append(count)
    # every connection was queued on one of the three (a connect returns once the kernel completed the handshake),
    # and by chance alone a socket is left without any with probability 3 * (2/3)**30, about 2e-5
    assert sum(held) == len(clients), held
    assert min(held) >= 1, f"every replica's socket got some of the connections: {held}"
