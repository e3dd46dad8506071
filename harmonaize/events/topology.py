"""Topology: where a job's nodes are, as far as the job needs to know to plan its parallelism.

The consumer is HSDP planning: shard inside a locality group (fast fabric), replicate across groups (slower
links). So the model says which of the job's hosts share a group, how many GPUs each has, and a coarse bandwidth
class inside each group and between pairs of groups. It deliberately says nothing finer: no rack, switch, NIC or
link names, no exact GPU SKU, no hosts outside the job. `GpuClass` is a memory bucket (what decides a sharding
plan) rather than a product name, and `BandwidthClass` is a range rather than a measurement.

The snapshot is self-consistent by construction: every node's group is listed, group and host pseudonyms are
unique, and links connect two different known groups at most once. A consumer can build a graph without
defensive checks.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Self

from pydantic import Field, model_validator

from harmonaize.events.base import ContractModel, EventData
from harmonaize.events.fields import GpuCount, GroupPseudonym, HostPseudonym
from harmonaize.events.kinds import EventKind

__all__ = ["BandwidthClass", "GpuClass", "GroupLink", "LocalityGroup", "Topology", "TopologyNode"]

MAX_NODES = 256
MAX_GROUPS = 64
MAX_LINKS = MAX_GROUPS * (MAX_GROUPS - 1) // 2


class GpuClass(StrEnum):
    """Coarse accelerator class by memory per GPU: enough to choose a sharding plan, too coarse to fingerprint."""

    NONE = "none"  # CPU-only node
    SMALL = "small"  # < 24 GiB
    MEDIUM = "medium"  # 24 to < 48 GiB
    LARGE = "large"  # 48 to < 96 GiB
    XLARGE = "xlarge"  # >= 96 GiB


class BandwidthClass(StrEnum):
    """Coarse per-GPU bandwidth between two points of the job, as ranges rather than link names or counters."""

    LOW = "low"  # < 25 Gb/s
    MEDIUM = "medium"  # 25 to < 100 Gb/s
    HIGH = "high"  # 100 to < 400 Gb/s
    VERY_HIGH = "very_high"  # >= 400 Gb/s (NVLink-class)


class TopologyNode(ContractModel):
    """One of the job's hosts."""

    host: HostPseudonym
    group: GroupPseudonym
    gpus: GpuCount
    gpu_class: GpuClass


class LocalityGroup(ContractModel):
    """A set of the job's hosts that share a fast fabric; HSDP shards within one."""

    group: GroupPseudonym
    intra_bandwidth: BandwidthClass


class GroupLink(ContractModel):
    """The bandwidth class between two locality groups (undirected)."""

    a: GroupPseudonym
    b: GroupPseudonym
    bandwidth: BandwidthClass

    @model_validator(mode="after")
    def _distinct_ends(self) -> Self:
        if self.a == self.b:
            raise ValueError(f"a link joins two different groups; got {self.a!r} twice (use intra_bandwidth)")
        return self


class Topology(EventData):
    """The job's current placement, grouped by locality."""

    KIND: ClassVar[EventKind] = EventKind.TOPOLOGY
    VERSION: ClassVar[int] = 1

    nodes: tuple[TopologyNode, ...] = Field(min_length=1, max_length=MAX_NODES)
    groups: tuple[LocalityGroup, ...] = Field(min_length=1, max_length=MAX_GROUPS)
    links: tuple[GroupLink, ...] = Field(default=(), max_length=MAX_LINKS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        hosts = [node.host for node in self.nodes]
        if len(set(hosts)) != len(hosts):
            raise ValueError("nodes: each host may appear once")
        groups = [group.group for group in self.groups]
        known = set(groups)
        if len(known) != len(groups):
            raise ValueError("groups: each group may appear once")
        unknown = sorted({node.group for node in self.nodes} - known)
        if unknown:
            raise ValueError(f"nodes: group(s) {unknown} not listed in groups")
        pairs: set[frozenset[str]] = set()
        for link in self.links:
            if link.a not in known or link.b not in known:
                raise ValueError(f"links: {link.a!r}-{link.b!r} refers to a group not listed in groups")
            pair = frozenset((link.a, link.b))
            if pair in pairs:
                raise ValueError(f"links: {link.a!r}-{link.b!r} appears more than once")
            pairs.add(pair)
        return self

    def hosts_by_group(self) -> dict[str, tuple[str, ...]]:
        """Host pseudonyms per group, in node order: the shard groups of an HSDP plan."""
        grouped: dict[str, list[str]] = {group.group: [] for group in self.groups}
        for node in self.nodes:
            grouped[node.group].append(node.host)
        return {group: tuple(hosts) for group, hosts in grouped.items()}
