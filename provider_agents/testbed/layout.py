"""Where everything of one testbed lives: namespace and interface names, addresses, groups. Pure, no I/O.

Each simulated host is a network namespace `hz-<cloud>-<host>` with two interfaces: `data` (the job's traffic,
198.18.0.0/16) and `mgmt` (broker, API and the provider's stores, 198.19.<n>.0/24). A `fabric` namespace holds the
switches: a data bridge per locality group, a spine bridge joining them through one veth *uplink* per group (the
inter-group link, shaped both ways: `links`), and the management bridge, whose uplink to the machine's own
namespace carries the services' address. Two planes, two subnets, no forwarding anywhere: the job's traffic between
groups can only cross the shaped uplinks, and nothing in a namespace has a route off the machine.

Each group also holds a *neighbour*: a namespace with a data port only, standing for another tenant's machine on the
same switch, so cross-traffic over the uplinks comes from outside the fleet (`traffic`). The fabric's and the
neighbours' names contain a dot, which no host id can, so they never collide with a host's.

Every name carries the cloud's id (12 hex chars, `markers.cloud_id`): the namespaces by prefix, the one interface in
the machine's namespace as `hz<cloud>m` (15 characters, the kernel's limit). Names inside a namespace are private to
it, so they can be short and the same in every testbed. The data subnet exists only inside the fabric, so every
testbed uses the same one; the management subnet is routed in the machine's namespace and is therefore one /24 per
testbed, chosen free when it is built (so at most 253 hosts).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from harmonaize.ids import is_valid_id

__all__ = ["DATA_NET", "MGMT_NET", "TestbedHost", "TestbedLayout", "TestbedNeighbour"]

DATA_NET = ipaddress.IPv4Network("198.18.0.0/16")
MGMT_NET = ipaddress.IPv4Network("198.19.0.0/16")
"""Both halves of the benchmarking range 198.18.0.0/15 (RFC 2544): never routed on any real network."""
MAX_HOSTS = 253
CLOUD_HEX = 12


@dataclass(frozen=True)
class TestbedHost:
    name: str
    group: str
    index: int
    namespace: str
    data_address: str
    mgmt_address: str

    @property
    def fabric_ports(self) -> tuple[str, str]:
        """Its data and management ports on the fabric's bridges (names inside the fabric namespace)."""
        return f"h{self.index}d", f"h{self.index}m"


@dataclass(frozen=True)
class TestbedNeighbour:
    """Another tenant's machine in `group`: a data port only, the source or sink of cross-traffic."""

    group: str
    index: int
    namespace: str
    data_address: str

    @property
    def fabric_port(self) -> str:
        return f"n{self.index}d"


@dataclass(frozen=True)
class TestbedLayout:
    """One cloud's testbed: hosts in locality groups, the groups' uplink rate, the management /24."""

    cloud: str
    hosts: tuple[TestbedHost, ...]
    groups: tuple[str, ...]
    uplink_mbit: float
    mgmt_subnet: int
    """`n` of 198.19.n.0/24."""
    neighbours: tuple[TestbedNeighbour, ...] = ()

    @classmethod
    def build(
        cls, cloud: str, hosts: Mapping[str, str], *, uplink_mbit: float, mgmt_subnet: int = 0
    ) -> TestbedLayout:
        """`hosts`: host -> locality group, in order; `uplink_mbit`: each group's link to the others."""
        if len(cloud) != CLOUD_HEX or any(c not in "0123456789abcdef" for c in cloud):
            raise ValueError(f"a testbed needs a cloud id of {CLOUD_HEX} hex characters, got {cloud!r}")
        if not hosts:
            raise ValueError("a testbed needs at least one host")
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"a testbed holds at most {MAX_HOSTS} hosts, not {len(hosts)}")
        if not 0 < uplink_mbit <= 10_000:
            raise ValueError(f"the uplink rate must be in (0, 10000] Mbit/s, got {uplink_mbit}")
        if not 0 <= mgmt_subnet <= 254:
            raise ValueError(f"the management subnet 198.19.n.0/24 needs n in 0..254, got {mgmt_subnet}")
        for name, group in hosts.items():
            for kind, value in (("host", name), ("locality group", group)):
                if not is_valid_id(value):
                    raise ValueError(f"invalid {kind} id {value!r} for a testbed namespace")
        groups = tuple(dict.fromkeys(hosts.values()))
        built = tuple(
            TestbedHost(
                name=name,
                group=group,
                index=index,
                namespace=f"{namespace_prefix(cloud)}{name}",
                data_address=str(DATA_NET.network_address + 256 * (index // 250) + index % 250 + 1),
                mgmt_address=f"198.19.{mgmt_subnet}.{index + 1}",
            )
            for index, (name, group) in enumerate(hosts.items())
        )
        neighbours = tuple(
            TestbedNeighbour(
                group=group,
                index=index,
                namespace=f"{namespace_prefix(cloud)}.nbr{index}",
                data_address=str(DATA_NET.network_address + 255 * 256 + index + 1),
            )
            for index, group in enumerate(groups)
        )
        return cls(
            cloud=cloud, hosts=built, groups=groups, uplink_mbit=uplink_mbit, mgmt_subnet=mgmt_subnet,
            neighbours=neighbours,
        )

    def to_json(self) -> str:
        """What an agent in a host namespace reads to know its testbed (`from_json`)."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TestbedLayout:
        raw = json.loads(text)
        return cls(
            cloud=raw["cloud"],
            hosts=tuple(TestbedHost(**host) for host in raw["hosts"]),
            groups=tuple(raw["groups"]),
            uplink_mbit=float(raw["uplink_mbit"]),
            mgmt_subnet=int(raw["mgmt_subnet"]),
            neighbours=tuple(TestbedNeighbour(**n) for n in raw.get("neighbours", ())),
        )

    @classmethod
    def load(cls, path: Path) -> TestbedLayout:
        return cls.from_json(path.read_text())

    @property
    def prefix(self) -> str:
        return namespace_prefix(self.cloud)

    @property
    def fabric(self) -> str:
        return f"{self.prefix}.fabric"

    @property
    def root_interface(self) -> str:
        """The management uplink's end in the machine's own namespace, where the services listen."""
        return root_interface(self.cloud)

    @property
    def services_address(self) -> str:
        """Where the broker, the API and the stores are reached from every host namespace."""
        return f"198.19.{self.mgmt_subnet}.254"

    def host(self, name: str) -> TestbedHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in the testbed")

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the testbed, sorted."""
        return sorted([self.fabric, *(h.namespace for h in self.hosts), *(n.namespace for n in self.neighbours)])

    def neighbour(self, group: str) -> TestbedNeighbour:
        for neighbour in self.neighbours:
            if neighbour.group == group:
                return neighbour
        raise KeyError(f"no locality group {group!r} in the testbed")

    def group_bridge(self, group: str) -> str:
        return f"d{self.groups.index(group)}"

    def uplink(self, group: str) -> tuple[str, str]:
        """(group side, spine side) of `group`'s uplink, inside the fabric: each end shapes what it sends."""
        index = self.groups.index(group)
        return f"u{index}", f"s{index}"


def namespace_prefix(cloud: str) -> str:
    """The start of every namespace of `cloud`'s testbed (and of no other cloud's)."""
    return f"hz-{cloud}-"


def root_interface(cloud: str) -> str:
    return f"hz{cloud}m"
