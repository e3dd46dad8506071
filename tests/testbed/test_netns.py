"""The testbed's namespaces on this machine: four hosts in two locality groups, their traffic between groups through
the shaped uplinks only, the services' address reachable and nothing else; removal leaves nothing; a rebuild after a
crash removes only that cloud's leftovers, beside another testbed that keeps working."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable

import pytest

from provider_agents.testbed import layout as testbed_layout
from provider_agents.testbed.commands import run
from provider_agents.testbed.links import CONGESTION_CONTROL, counters, shape
from provider_agents.testbed.netns import build, namespaces_of, remove
from tests.testbed.traffic import in_namespace, transfer_mbit

pytestmark = pytest.mark.timeout(180)

HOSTS = {"h1": "g1", "h2": "g1", "h3": "g2", "h4": "g2"}
UPLINK_MBIT = 40.0
SIZE = 3_000_000  # bytes per transfer: 0.6 s at 40 Mbit/s


def _reaches(namespace: str, address: str, port: int) -> bool:
    probe = "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n" \
            "except OSError:\n    sys.exit(1)\n"
    return subprocess.run(in_namespace(namespace, probe, address, str(port)), timeout=10).returncode == 0


def test_two_groups_talk_through_the_shaped_uplink_and_reach_only_the_services(
    new_cloud: Callable[[], str],
) -> None:
    cloud = new_cloud()
    layout = build(cloud, HOSTS, uplink_mbit=UPLINK_MBIT)
    assert namespaces_of(cloud) == layout.namespaces
    h1, h2, h3 = layout.host("h1"), layout.host("h2"), layout.host("h3")
    assert (h1.data_address, h3.data_address) == ("198.18.0.1", "198.18.0.3")

    within = transfer_mbit(h1.namespace, h2.namespace, h2.data_address, size=SIZE)
    across = transfer_mbit(h1.namespace, h3.namespace, h3.data_address, size=SIZE)
    n1, n2 = layout.neighbour("g1"), layout.neighbour("g2")
    assert transfer_mbit(n1.namespace, n2.namespace, n2.data_address, size=SIZE // 2, port=5203) < 1.2 * UPLINK_MBIT
    assert 0.5 * UPLINK_MBIT < across < 1.2 * UPLINK_MBIT, f"across the uplink {across:.1f} Mbit/s"
    assert within > 3 * UPLINK_MBIT, f"within a group {within:.1f} Mbit/s: not shaped"
    group_end, _ = layout.uplink("g1")
    sent = counters(layout.fabric, group_end)
    assert sent.bytes_sent >= SIZE and sent.rate_bps == pytest.approx(UPLINK_MBIT * 1e6, rel=0.01)

    shape(layout.fabric, group_end, UPLINK_MBIT / 4)  # a lowered link: the next transfer is four times slower
    slowed = transfer_mbit(h1.namespace, h3.namespace, h3.data_address, size=SIZE // 4, port=5202)
    assert slowed < 0.4 * UPLINK_MBIT, f"after lowering the uplink {slowed:.1f} Mbit/s"

    with socket.create_server((layout.services_address, 0)) as services:
        port = services.getsockname()[1]
        assert _reaches(h3.namespace, layout.services_address, port), "the services' address from a host"
    assert run(["ip", "-n", h1.namespace, "route", "show", "default"]).strip() == "", "no way off the machine"
    for namespace in (h1.namespace, n1.namespace):  # TCP as the link model assumes, not the machine's default
        data = run(["ip", "-n", namespace, "route", "show", str(testbed_layout.DATA_NET)])
        assert f"congctl {CONGESTION_CONTROL}" in data, data
    with socket.create_server(("127.0.0.1", 0)) as loopback:
        assert not _reaches(h1.namespace, "127.0.0.1", loopback.getsockname()[1]), "the machine's loopback is not"

    assert remove(cloud) and namespaces_of(cloud) == []
    assert run(["ip", "-o", "link", "show", "dev", layout.root_interface], check=False) == ""


def test_a_rebuild_after_a_crash_removes_that_clouds_leftovers_only(new_cloud: Callable[[], str]) -> None:
    crashed, other = new_cloud(), new_cloud()
    first = build(crashed, {"h1": "g1", "h2": "g2"}, uplink_mbit=UPLINK_MBIT)
    neighbour = build(other, HOSTS, uplink_mbit=UPLINK_MBIT)
    assert neighbour.mgmt_subnet != first.mgmt_subnet, "two testbeds never share a management subnet"
    run(["ip", "netns", "add", f"hz-{crashed}-orphan"])  # what a run killed mid-build could leave

    again = build(crashed, {"h1": "g1", "h2": "g2"}, uplink_mbit=UPLINK_MBIT)
    assert namespaces_of(crashed) == again.namespaces
    assert namespaces_of(other) == neighbour.namespaces
    assert testbed_layout.TestbedLayout.from_json(neighbour.to_json()) == neighbour
    n1, n3 = neighbour.host("h1"), neighbour.host("h3")
    assert transfer_mbit(n1.namespace, n3.namespace, n3.data_address, size=SIZE) > 0.5 * UPLINK_MBIT

    with pytest.raises(ValueError, match="malformed cloud id"):
        remove("hz")
    with pytest.raises(ValueError, match="invalid host id"):
        testbed_layout.TestbedLayout.build(crashed, {"bad name": "g1"}, uplink_mbit=1)
