"""Ports for servers are chosen where outgoing connections never take them: below the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from broker_config.server import LISTEN_PORT_FLOOR, free_port, port_is_free


def _ephemeral_low() -> int:
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not path.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range on this system: the kernel's choice is used")
    return int(path.read_text().split()[0])


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = _ephemeral_low()
    if low - LISTEN_PORT_FLOOR < 1000:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it, so the kernel's choice is used")
    ports = [free_port() for _ in range(50)]
    assert all(LISTEN_PORT_FLOOR <= port < low for port in ports), ports
    assert all(port_is_free("127.0.0.1", port) for port in ports)


def test_a_port_in_use_is_never_handed_out() -> None:
    low = _ephemeral_low()
    held = []
    try:
        for _ in range(20):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == 20
        assert all(port not in taken for port in (free_port() for _ in range(200)))
        assert all(port < low or low == 0 for port in taken)
    finally:
        for s in held:
            s.close()
