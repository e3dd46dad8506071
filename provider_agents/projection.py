"""The privacy projection: raw host telemetry + desired state -> what each tenant may see, as CloudEvents.

This is the only way from provider-internal data to a tenant. It is a pure function (no I/O, no clock, no state), so
it can be tested exhaustively, and a property test feeds it random fleets, names and telemetry and checks that
nothing internal or foreign comes out. The rules, each enforced here:

1. **Only the tenant's own jobs.** Events are made per (tenant, job) for the jobs the desired state places on this
   host, and carry that tenant's id and job id only (the subject `hz.t.<tenant>.events.<kind>.<job>` and the
   CloudEvents `subject`). Nothing about another tenant, or about hosts the job does not run on, is consulted for a
   tenant's event except to decide *whether* to report.
2. **Pseudonyms, never names.** Hosts and locality groups appear as per-tenant keyed hashes
   (`harmonaize.pseudonyms`), so two tenants cannot match notes to learn they share hardware, and the provider's naming
   scheme stays private. Maintenance notice ids are hashed per tenant the same way. The CloudEvents `source` is
   built from the same host pseudonym. Lists are ordered by pseudonym, not by internal name, so not even the sort
   order of internal names leaks.
3. **Outcomes, not measurements.** Congestion becomes a level and a coarse expected slowdown for a scope (inside a
   group / between groups) and the affected groups, and only on the job's own paths: an intra-group link matters to
   a job with at least two hosts in that group, an inter-group link to a job with hosts in both groups. A job no
   link touches gets nothing. Link and switch names, utilisation and other tenants' flows are dropped.
4. **Host-local facts to the host's tenants only.** Failures and maintenance of this host go to the jobs on this
   host. GPU serials and component names are dropped; a failure `reason` passes only if it is in a fixed public
   vocabulary (`xid_<n>`, `ecc_uncorrectable`, ...), so free text cannot smuggle a name out.
5. **Region-level carbon.** The grid zone key (public) and its intensity and forecast; nothing about the site.
6. **Coarse capacity.** Free GPUs are reported per group as `bucket_for_free_gpus` buckets (`capacity_view`).

Job-wide facts (topology, carbon, congestion on a path) would otherwise be reported by every host of a job. Exactly
one host reports each: among the job's hosts that can see the fact, the one whose pseudonym *for that tenant* sorts
first. Every agent computes the same answer from the shared desired state, and choosing by pseudonym rather than by
internal name keeps the choice from revealing how the provider names its hosts.

Events carry fresh UUIDv7 ids; `TenantEvent.slot` names which piece of state an event is the latest value of
(built from tenant-facing values only), so `changes.ChangeTracker` can publish only what changed. A projection has
at most one event per slot and job, and its value is a function of the snapshot alone: when several raw signals land
on one slot (the same failure reported twice, two failures a tenant cannot tell apart, one notice id listed twice),
a fixed order picks the one the tenant sees. Otherwise the slot's value would alternate within a tick, and every tick
would look like news.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import combinations
from typing import Any, TypeVar

from harmonaize.desired_state import HostAssignment
from harmonaize.events import (
    BandwidthClass,
    Capacity,
    CarbonIntensity,
    CloudEvent,
    Congestion,
    CongestionLevel,
    CongestionScope,
    EventData,
    Failure,
    FailureKind,
    ForecastPoint,
    GpuClass,
    GroupCapacity,
    GroupLink,
    LocalityGroup,
    Maintenance,
    MaintenanceStatus,
    MaintenanceWindow,
    Severity,
    Topology,
    TopologyNode,
    agent_source,
    bucket_for_free_gpus,
    make_event,
)
from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym
from harmonaize.subjects import tenant_event_subject
from harmonaize.tracing import new_traceparent
from provider_agents.telemetry.model import FailureSignal, HostTelemetry, LinkCongestion, RawFailureKind

__all__ = [
    "PUBLIC_REASONS",
    "TenantEvent",
    "bandwidth_class",
    "capacity_view",
    "congestion_level",
    "gpu_class",
    "host_down",
    "notice_pseudonym",
    "project",
    "public_reason",
]

PUBLIC_REASONS = frozenset(
    {
        "ecc_uncorrectable",
        "ecc_retired_pages",
        "row_remap_failure",
        "row_remap_pending",
        "thermal",
        "power_brake",
        "nvlink_error",
        "pcie_error",
        "fallen_off_bus",
    }
)
"""Failure reasons a tenant may see, besides `xid_<n>` (NVIDIA's public error codes)."""

_XID_RE = re.compile(r"xid_[0-9]{1,3}", re.ASCII)
_MAX_FORECAST = 336
_MAX_GPUS_PER_NODE = 64
_URGENT_PREDICTION = timedelta(minutes=15)


@dataclass(frozen=True, slots=True)
class TenantEvent:
    """One event for one tenant's job, and the piece of state (`slot`) it reports."""

    tenant: str
    job: str
    slot: str
    event: CloudEvent[Any]

    @property
    def subject(self) -> str:
        return tenant_event_subject(self.tenant, self.event.data.KIND, self.job)


def public_reason(reason: str | None) -> str | None:
    """The reason if it is public vocabulary, else None (free text never reaches a tenant)."""
    if reason is None:
        return None
    if reason in PUBLIC_REASONS or _XID_RE.fullmatch(reason):
        return reason
    return None


def notice_pseudonym(secret: bytes, tenant: str, notice_id: str) -> str:
    """A maintenance notice id as `tenant` sees it: shared notices must not link tenants to each other."""
    if not secret:
        raise ValueError("a pseudonym needs a non-empty provider secret")
    message = b"".join(len(p).to_bytes(4, "big") + p for p in (b"notice", tenant.encode(), notice_id.encode()))
    return "m-" + hmac.new(secret, message, hashlib.sha256).hexdigest()[:16]


def congestion_level(slowdown: float) -> CongestionLevel:
    """The level a tenant sees for an expected slowdown factor."""
    if slowdown < 1.05:
        return CongestionLevel.NONE
    if slowdown < 1.25:
        return CongestionLevel.LOW
    if slowdown < 1.75:
        return CongestionLevel.MODERATE
    if slowdown < 3.0:
        return CongestionLevel.HIGH
    return CongestionLevel.SEVERE


def bandwidth_class(gbps: float) -> BandwidthClass:
    if gbps < 25:
        return BandwidthClass.LOW
    if gbps < 100:
        return BandwidthClass.MEDIUM
    if gbps < 400:
        return BandwidthClass.HIGH
    return BandwidthClass.VERY_HIGH


def gpu_class(memory_gib: float) -> GpuClass:
    if memory_gib <= 0:
        return GpuClass.NONE
    if memory_gib < 24:
        return GpuClass.SMALL
    if memory_gib < 48:
        return GpuClass.MEDIUM
    if memory_gib < 96:
        return GpuClass.LARGE
    return GpuClass.XLARGE


@dataclass(frozen=True)
class _Placement:
    host: str
    group: str
    gpus: int


@dataclass
class _JobView:
    """What the projection knows about one job while building its events; never serialised."""

    tenant: str
    job: str
    here: str
    placements: tuple[_Placement, ...]
    secret: bytes
    sampled_at: datetime
    hosts: dict[str, str] = field(init=False)
    groups: dict[str, str] = field(init=False)
    hosts_by_group: dict[str, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.hosts = {p.host: host_pseudonym(self.secret, self.tenant, p.host) for p in self.placements}
        self.groups = {p.group: locality_pseudonym(self.secret, self.tenant, p.group) for p in self.placements}
        self.hosts_by_group = {}
        for p in self.placements:
            self.hosts_by_group.setdefault(p.group, []).append(p.host)

    def reports(self, among: Iterable[str] | None = None) -> bool:
        """Whether this host is the one that reports a fact seen by the job's hosts in `among` groups (all if None)."""
        candidates = [p.host for p in self.placements if among is None or p.group in among]
        return bool(candidates) and min(candidates, key=self.hosts.__getitem__) == self.here

    def event(self, data: EventData, slot: str) -> TenantEvent:
        source = agent_source(self.hosts[self.here])
        return TenantEvent(
            self.tenant,
            self.job,
            slot,
            make_event(data, source=source, subject=self.job, time=self.sampled_at, traceparent=new_traceparent()),
        )


def _placements(fleet: Mapping[str, HostAssignment]) -> dict[tuple[str, str], dict[str, _Placement]]:
    placed: dict[tuple[str, str], dict[str, _Placement]] = {}
    for assignment in fleet.values():
        for job in assignment.jobs:
            where = placed.setdefault((job.tenant, job.job), {})
            previous = where.get(assignment.host)
            gpus = job.gpus + (previous.gpus if previous else 0)
            where[assignment.host] = _Placement(assignment.host, assignment.locality_group, gpus)
    return placed


def project(
    telemetry: HostTelemetry,
    assignment: HostAssignment,
    secret: bytes,
    *,
    fleet: Mapping[str, HostAssignment] | None = None,
) -> tuple[TenantEvent, ...]:
    """The current state of every tenant job on this host, as that tenant may see it.

    `assignment` is this host's desired state; `fleet` (every host's, when known) tells where else each job runs,
    which decides the job's paths, its topology and which host reports job-wide facts. Without it, each job is taken
    to run on this host alone.
    """
    if telemetry.host != assignment.host:
        raise ValueError(f"telemetry of host {telemetry.host!r} projected with the assignment of {assignment.host!r}")
    placed = _placements({**(fleet or {}), assignment.host: assignment})
    events: list[TenantEvent] = []
    seen: set[tuple[str, str]] = set()
    for job in assignment.jobs:
        key = (job.tenant, job.job)
        if key in seen:
            continue
        seen.add(key)
        view = _JobView(
            tenant=job.tenant,
            job=job.job,
            here=assignment.host,
            placements=tuple(placed[key].values()),
            secret=secret,
            sampled_at=telemetry.sampled_at,
        )
        events += _topology(view, telemetry)
        events += _congestion(view, telemetry.links)
        events += _failures(view, telemetry.failures)
        events += _maintenance(view, telemetry)
        events += _carbon(view, telemetry)
    return tuple(events)


def _topology(view: _JobView, telemetry: HostTelemetry) -> list[TenantEvent]:
    if not view.reports():
        return []
    node_class = gpu_class(telemetry.gpu_memory_gib)
    nodes = sorted(
        (
            TopologyNode(
                host=view.hosts[p.host],
                group=view.groups[p.group],
                gpus=min(p.gpus, _MAX_GPUS_PER_NODE),
                gpu_class=node_class if p.gpus > 0 else GpuClass.NONE,
            )
            for p in view.placements
        ),
        key=lambda node: node.host,
    )
    group_names = sorted(view.groups.values())
    intra = bandwidth_class(telemetry.fabric.intra_group_gbps)
    inter = bandwidth_class(telemetry.fabric.inter_group_gbps)
    topology = Topology(
        nodes=tuple(nodes),
        groups=tuple(LocalityGroup(group=g, intra_bandwidth=intra) for g in group_names),
        links=tuple(GroupLink(a=a, b=b, bandwidth=inter) for a, b in combinations(group_names, 2)),
    )
    return [view.event(topology, "topology")]


def _on_job_path(view: _JobView, link: LinkCongestion) -> CongestionScope | None:
    if len(link.groups) == 1:
        together = len(view.hosts_by_group.get(link.groups[0], ()))
        return CongestionScope.INTRA_GROUP if together >= 2 else None
    if all(group in view.hosts_by_group for group in link.groups):
        return CongestionScope.INTER_GROUP
    return None


def _congestion(view: _JobView, links: Iterable[LinkCongestion]) -> list[TenantEvent]:
    paths: dict[tuple[CongestionScope, tuple[str, ...]], list[LinkCongestion]] = {}
    for link in links:
        scope = _on_job_path(view, link)
        if scope is not None and view.reports(among=link.groups):
            paths.setdefault((scope, tuple(sorted(link.groups))), []).append(link)
    events = []
    for (scope, groups), path_links in paths.items():
        slowdown = max(link.slowdown for link in path_links)
        level = congestion_level(slowdown)
        if level is CongestionLevel.NONE:
            continue
        ends = [link.expected_until for link in path_links]
        pseudonyms = tuple(sorted(view.groups[g] for g in groups))
        data = Congestion(
            level=level,
            slowdown=round(min(slowdown, 100.0), 2),
            scope=scope,
            groups=pseudonyms,
            since=min(link.since for link in path_links),
            expected_until=None if any(end is None for end in ends) else max(e for e in ends if e is not None),
        )
        events.append(view.event(data, f"congestion:{scope.value}:{','.join(pseudonyms)}"))
    return events


def _severity(signal: FailureSignal, now: datetime) -> Severity:
    if signal.kind is RawFailureKind.GPU_ERROR:
        return Severity.CRITICAL
    if signal.kind is RawFailureKind.DEGRADED:
        return Severity.WARNING
    assert signal.eta is not None and signal.confidence is not None
    urgent = signal.confidence >= 0.8 and signal.eta - now <= _URGENT_PREDICTION
    return Severity.CRITICAL if urgent else Severity.WARNING


_SEVERITY_FIRST = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}
_STATUS_FIRST = {
    MaintenanceStatus.COMPLETED: 0,
    MaintenanceStatus.CANCELLED: 0,
    MaintenanceStatus.STARTED: 1,
    MaintenanceStatus.SCHEDULED: 2,
}


def _failure_order(data: Failure) -> tuple[Any, ...]:
    """Which of the failures on one slot the tenant sees: the most urgent, and of equals the oldest.

    A condition then keeps its first `detected_at` however often it is reported again, and a second failure the
    tenant cannot tell apart becomes news only when the first one ends. Every field that can differ within a slot
    is in the key, so the choice never depends on the order of the signals.
    """
    far = datetime.max.replace(tzinfo=data.detected_at.tzinfo)
    return (_SEVERITY_FIRST[data.severity], data.eta or far, -(data.confidence or 0.0), data.detected_at)


def _maintenance_order(data: Maintenance) -> tuple[Any, ...]:
    """Which of the notices under one id the tenant sees: the furthest along, then the earliest window.

    Furthest along first keeps what the tenant sees of a notice moving forward, as the contract promises.
    """
    window = data.window
    status = (_STATUS_FIRST[data.status], data.status.value)
    return (*status, window.not_before, window.not_after, data.kind.value, data.early_approval)


_Data = TypeVar("_Data", bound=EventData)


def _one_per_slot(
    view: _JobView, candidates: Iterable[tuple[str, _Data]], order: Callable[[_Data], tuple[Any, ...]]
) -> list[TenantEvent]:
    """One event per slot, the first of its candidates by `order`; events ordered by slot."""
    chosen: dict[str, _Data] = {}
    for slot, data in candidates:
        if slot not in chosen or order(data) < order(chosen[slot]):
            chosen[slot] = data
    return [view.event(chosen[slot], slot) for slot in sorted(chosen)]


def _failures(view: _JobView, failures: Iterable[FailureSignal]) -> list[TenantEvent]:
    candidates = []
    for signal in failures:
        reason = public_reason(signal.reason)
        data = Failure(
            kind=FailureKind(signal.kind.value),
            host=view.hosts[view.here],
            gpu_index=signal.gpu_index,
            detected_at=signal.detected_at,
            severity=_severity(signal, view.sampled_at),
            eta=signal.eta,
            confidence=signal.confidence,
            reason=reason,
        )
        gpu = "host" if signal.gpu_index is None else str(signal.gpu_index)
        candidates.append((f"failure:{signal.kind.value}:{gpu}:{reason or '-'}", data))
    return _one_per_slot(view, candidates, _failure_order)


def _maintenance(view: _JobView, telemetry: HostTelemetry) -> list[TenantEvent]:
    candidates = []
    for notice in telemetry.maintenance:
        notice_id = notice_pseudonym(view.secret, view.tenant, notice.notice_id)
        data = Maintenance(
            notice_id=notice_id,
            kind=notice.kind,
            status=notice.status,
            window=MaintenanceWindow(not_before=notice.not_before, not_after=notice.not_after),
            hosts=(view.hosts[view.here],),
            early_approval=notice.early_approval,
        )
        candidates.append((f"maintenance:{notice_id}", data))
    return _one_per_slot(view, candidates, _maintenance_order)


def _carbon(view: _JobView, telemetry: HostTelemetry) -> list[TenantEvent]:
    reading = telemetry.carbon
    if reading is None or not view.reports():
        return []
    data = CarbonIntensity(
        region=reading.region,
        g_per_kwh=float(reading.g_per_kwh),
        observed_at=reading.observed_at,
        forecast=tuple(ForecastPoint(at=p.at, g_per_kwh=float(p.g_per_kwh)) for p in reading.forecast[:_MAX_FORECAST]),
    )
    return [view.event(data, "carbon")]


def host_down(assignment: HostAssignment, secret: bytes, *, detected_at: datetime) -> tuple[TenantEvent, ...]:
    """A `host_down` failure for every tenant job the desired state places on a host that stopped answering."""
    events = []
    seen: set[tuple[str, str]] = set()
    for job in assignment.jobs:
        if (job.tenant, job.job) in seen:
            continue
        seen.add((job.tenant, job.job))
        pseudonym = host_pseudonym(secret, job.tenant, assignment.host)
        data = Failure(kind=FailureKind.HOST_DOWN, host=pseudonym, detected_at=detected_at, severity=Severity.CRITICAL)
        event = make_event(
            data, source=agent_source(pseudonym), subject=job.job, time=detected_at, traceparent=new_traceparent()
        )
        events.append(TenantEvent(job.tenant, job.job, "failure:host_down", event))
    return tuple(events)


def capacity_view(
    tenant: str,
    secret: bytes,
    *,
    free_gpus_by_group: Mapping[str, int],
    max_workers: int,
    as_of: datetime,
) -> Capacity:
    """Coarse availability for `tenant`: per-group buckets under that tenant's group pseudonyms.

    For whoever knows the whole fleet's free GPUs (a single host agent does not, so agents do not publish it).
    """
    groups = sorted(
        (
            GroupCapacity(group=locality_pseudonym(secret, tenant, group), free_gpus=bucket_for_free_gpus(free))
            for group, free in free_gpus_by_group.items()
        ),
        key=lambda entry: entry.group,
    )
    return Capacity(groups=tuple(groups), max_workers=max_workers, as_of=as_of)
