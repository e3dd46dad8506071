"""Builds and removes one cloud's testbed (`layout.TestbedLayout`) with iproute2: namespaces, veths, bridges, qdiscs.

Everything is made with `ip` and `tc` (the kernel's own tools; no library wraps network namespaces better). A build
first removes whatever a crashed run of the same cloud left (`remove`, by the cloud's prefix), never another cloud's.
A failed command raises `TestbedError` naming the command and the kernel's words, after undoing the partial build.
`remove` is idempotent: deleting a namespace deletes its veths and their peers, and the fabric's deletion takes the
management uplink's end in the machine's namespace with it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from collections.abc import Mapping

from provider_agents.testbed.commands import TestbedError
from provider_agents.testbed.commands import run as _run
from provider_agents.testbed.layout import (
    CLOUD_HEX,
    DATA_NET,
    MGMT_NET,
    TestbedLayout,
    namespace_prefix,
    root_interface,
)
from provider_agents.testbed.links import data_route, shape

__all__ = ["TestbedError", "build", "namespaces_of", "remove", "unavailable"]

def unavailable() -> str | None:
    """Why no testbed can be built here (None: it can): not root, or no iproute2."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces); running on loopback instead"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the testbed needs `{tool}` (iproute2); running on loopback instead"
    try:
        _run(["ip", "netns", "list"])
    except TestbedError as exc:
        return f"network namespaces are not available ({exc}); running on loopback instead"
    return None


def namespaces_of(cloud: str) -> list[str]:
    """The namespaces of `cloud`'s testbed that exist now (a crashed run's included)."""
    prefix = namespace_prefix(cloud)
    names = (line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip())
    return sorted(name for name in names if name.startswith(prefix))


def remove(cloud: str) -> list[str]:
    """Delete every namespace of `cloud` and its management uplink; returns what was removed."""
    if len(cloud) != CLOUD_HEX:
        raise ValueError(f"refusing to remove namespaces for a malformed cloud id {cloud!r}")
    removed = []
    for namespace in namespaces_of(cloud):
        _run(["ip", "netns", "del", namespace], check=False)
        removed.append(namespace)
    interface = root_interface(cloud)
    if _run(["ip", "-o", "link", "show", "dev", interface], check=False):
        _run(["ip", "link", "del", interface], check=False)
        removed.append(interface)
    return removed


def free_mgmt_subnet(preferred: int) -> int:
    """A 198.19.n.0/24 no interface of this machine's namespace uses yet (another testbed's), from `preferred` on."""
    used: set[int] = set()
    for link in json.loads(_run(["ip", "-j", "-4", "addr", "show"]) or "[]"):
        for info in link.get("addr_info", []):
            local = ipaddress.ip_address(str(info.get("local", "0.0.0.0")))
            if local in MGMT_NET:
                used.add(local.packed[2])
    for offset in range(255):
        candidate = (preferred + offset) % 255
        if candidate not in used:
            return candidate
    raise TestbedError("every 198.19.n.0/24 management subnet is in use on this machine")


def build(cloud: str, hosts: Mapping[str, str], *, uplink_mbit: float) -> TestbedLayout:
    """Make `cloud`'s testbed (host -> locality group; each group's uplink rate), removing a stale one of the same
    cloud first; returns its layout. On a failure nothing of it is left."""
    remove(cloud)
    preferred = int(cloud[:4], 16) % 255  # spreads clouds over the subnets; a taken one moves to the next free
    layout = TestbedLayout.build(cloud, hosts, uplink_mbit=uplink_mbit, mgmt_subnet=free_mgmt_subnet(preferred))
    try:
        _build(layout)
    except BaseException:
        remove(cloud)
        raise
    return layout


def _build(layout: TestbedLayout) -> None:
    fabric = layout.fabric
    _run(["ip", "netns", "add", fabric])
    in_fabric = ["ip", "-n", fabric]
    _run([*in_fabric, "link", "set", "lo", "up"])
    _bridge(fabric, "mgmt")
    for group in layout.groups:
        _bridge(fabric, layout.group_bridge(group))
    if len(layout.groups) > 1:
        _bridge(fabric, "spine")
        for group in layout.groups:
            group_end, spine_end = layout.uplink(group)
            _run([*in_fabric, "link", "add", group_end, "type", "veth", "peer", "name", spine_end])
            _run([*in_fabric, "link", "set", group_end, "master", layout.group_bridge(group), "up"])
            _run([*in_fabric, "link", "set", spine_end, "master", "spine", "up"])
            shape(fabric, group_end, layout.uplink_mbit)
            shape(fabric, spine_end, layout.uplink_mbit)
    root = layout.root_interface
    _run(["ip", "link", "add", root, "type", "veth", "peer", "name", "rootm", "netns", fabric])
    _run(["ip", "addr", "add", f"{layout.services_address}/24", "dev", root])
    _run(["ip", "link", "set", root, "up"])
    _run([*in_fabric, "link", "set", "rootm", "master", "mgmt", "up"])
    for host in layout.hosts:
        _run(["ip", "netns", "add", host.namespace])
        in_host = ["ip", "-n", host.namespace]
        _run([*in_host, "link", "set", "lo", "up"])
        data_port, mgmt_port = host.fabric_ports
        for interface, port, address, prefix, bridge in (
            ("data", data_port, host.data_address, 16, layout.group_bridge(host.group)),
            ("mgmt", mgmt_port, host.mgmt_address, 24, "mgmt"),
        ):
            _run([*in_host, "link", "add", interface, "type", "veth", "peer", "name", port, "netns", fabric])
            _run([*in_host, "addr", "add", f"{address}/{prefix}", "dev", interface])
            _run([*in_host, "link", "set", interface, "up"])
            _run([*in_fabric, "link", "set", port, "master", bridge, "up"])
        data_route(host.namespace, "data", network=str(DATA_NET), source=host.data_address)
    for neighbour in layout.neighbours:
        _run(["ip", "netns", "add", neighbour.namespace])
        _run(["ip", "-n", neighbour.namespace, "link", "set", "lo", "up"])
        port = neighbour.fabric_port
        _run(["ip", "-n", neighbour.namespace, "link", "add", "data", "type", "veth", "peer", "name", port,
              "netns", fabric])
        _run(["ip", "-n", neighbour.namespace, "addr", "add", f"{neighbour.data_address}/16", "dev", "data"])
        _run(["ip", "-n", neighbour.namespace, "link", "set", "data", "up"])
        _run([*in_fabric, "link", "set", port, "master", layout.group_bridge(neighbour.group), "up"])
        data_route(neighbour.namespace, "data", network=str(DATA_NET), source=neighbour.data_address)


def _bridge(namespace: str, name: str) -> None:
    _run(["ip", "-n", namespace, "link", "add", name, "type", "bridge"])
    _run(["ip", "-n", namespace, "link", "set", name, "up"])
