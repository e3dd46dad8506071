"""The privacy projection: examples of each rule, and a property test over random fleets and telemetry.

The property: whatever the placement, names and telemetry, a tenant's serialised event (JSON, subject) contains no
provider-internal identifier (host ids, locality groups, link names, GPU serials, notice ids, free-text reasons), no
other tenant's id or job, and only pseudonyms of the hosts and groups its own job runs on, made for that tenant.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmonaize.desired_state import HostAssignment
from harmonaize.events import (
    Availability,
    CongestionLevel,
    CongestionScope,
    FailureKind,
    MaintenanceKind,
    MaintenanceStatus,
    Severity,
    parse_event,
)
from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym
from harmonaize.subjects import tenant_event_subject
from provider_agents.changes import ChangeTracker
from provider_agents.projection import (
    TenantEvent,
    capacity_view,
    congestion_level,
    host_down,
    notice_pseudonym,
    project,
    public_reason,
)
from provider_agents.telemetry.model import (
    CarbonPoint,
    CarbonReading,
    FailureSignal,
    GpuSample,
    LinkCongestion,
    MaintenanceNotice,
    RawFailureKind,
)
from tests.agents.fakes import START, assignment, telemetry

SECRET = b"projection-test-secret"

# acme/train runs on h1, h2 (group g1) and h3 (g2); acme/solo on h1 only; globex/sim on h3 and h4 (g2).
FLEET = {
    "h1": assignment("h1", "g1", ("acme", "train"), ("acme", "solo")),
    "h2": assignment("h2", "g1", ("acme", "train")),
    "h3": assignment("h3", "g2", ("acme", "train"), ("globex", "sim")),
    "h4": assignment("h4", "g2", ("globex", "sim")),
}
GROUP = {"h1": "g1", "h2": "g1", "h3": "g2", "h4": "g2"}


def _everywhere(**parts: Any) -> list[TenantEvent]:
    """Project the same kind of telemetry on every host of the fleet."""
    events: list[TenantEvent] = []
    for host, desired in FLEET.items():
        events += project(telemetry(host, GROUP[host], **parts), desired, SECRET, fleet=FLEET)
    return events


def _of(events: list[TenantEvent], kind: str) -> list[TenantEvent]:
    return [e for e in events if e.event.data.KIND.value == kind]


def test_topology_is_reported_once_per_job_with_its_own_hosts_only() -> None:
    topologies = _of(_everywhere(), "topology")
    assert sorted((e.tenant, e.job) for e in topologies) == [("acme", "solo"), ("acme", "train"), ("globex", "sim")]
    train = next(e for e in topologies if e.job == "train").event.data
    assert {n.host for n in train.nodes} == {host_pseudonym(SECRET, "acme", h) for h in ("h1", "h2", "h3")}
    assert {g.group for g in train.groups} == {locality_pseudonym(SECRET, "acme", g) for g in ("g1", "g2")}
    assert len(train.links) == 1 and train.nodes[0].gpus == 4 and train.nodes[0].gpu_class.value == "large"
    assert [n.host for n in train.nodes] == sorted(n.host for n in train.nodes), "ordered by pseudonym"
    solo = next(e for e in topologies if e.job == "solo").event.data
    assert len(solo.nodes) == 1 and solo.links == ()


def test_the_reporter_is_chosen_by_the_tenants_pseudonym_not_the_internal_name() -> None:
    train = next(e for e in _of(_everywhere(), "topology") if e.job == "train")
    reporter = min(("h1", "h2", "h3"), key=lambda h: host_pseudonym(SECRET, "acme", h))
    assert train.event.source == f"/hz/provider/agent/{host_pseudonym(SECRET, 'acme', reporter)}"


def _link(name: str, *groups: str, slowdown: float = 2.5) -> LinkCongestion:
    return LinkCongestion(link=name, groups=groups, utilization=0.97, slowdown=slowdown, since=START)


def test_intra_group_congestion_reaches_only_jobs_with_two_hosts_in_that_group() -> None:
    events = _of(_everywhere(links=(_link("leaf-g1-up3", "g1"),)), "congestion")
    assert [(e.tenant, e.job) for e in events] == [("acme", "train")], "solo has one host in g1; globex is in g2"
    data = events[0].event.data
    assert data.scope is CongestionScope.INTRA_GROUP and data.level is CongestionLevel.HIGH and data.slowdown == 2.5
    assert data.groups == (locality_pseudonym(SECRET, "acme", "g1"),)
    events = _of(_everywhere(links=(_link("leaf-g2", "g2"),)), "congestion")
    assert [(e.tenant, e.job) for e in events] == [("globex", "sim")]


def test_inter_group_congestion_reaches_only_jobs_spanning_both_groups() -> None:
    links = (_link("spine-1", "g1", "g2", slowdown=5.0), _link("spine-9", "g2", "g3"))
    events = _of(_everywhere(links=links), "congestion")
    assert [(e.tenant, e.job) for e in events] == [("acme", "train")]
    data = events[0].event.data
    assert data.scope is CongestionScope.INTER_GROUP and data.level is CongestionLevel.SEVERE
    assert set(data.groups) == {locality_pseudonym(SECRET, "acme", g) for g in ("g1", "g2")}


def test_links_on_one_path_are_merged_and_a_negligible_slowdown_is_no_news() -> None:
    links = (_link("a", "g1", slowdown=1.3), _link("b", "g1", slowdown=2.0), _link("c", "g2", slowdown=1.01))
    events = _of(_everywhere(links=links), "congestion")
    assert [(e.job, e.event.data.slowdown) for e in events] == [("train", 2.0)]


@pytest.mark.parametrize(
    ("slowdown", "level"),
    [(1.0, "none"), (1.1, "low"), (1.5, "moderate"), (2.9, "high"), (3.0, "severe"), (80.0, "severe")],
)
def test_congestion_levels(slowdown: float, level: str) -> None:
    assert congestion_level(slowdown).value == level


def test_failures_go_to_every_job_on_the_failing_host_and_nowhere_else() -> None:
    failure = FailureSignal(
        kind=RawFailureKind.GPU_ERROR, gpu_index=3, component="SN-1650923", detected_at=START, reason="xid_79"
    )
    events = project(telemetry("h3", "g2", failures=(failure,)), FLEET["h3"], SECRET, fleet=FLEET)
    failures = _of(list(events), "failure")
    assert sorted((e.tenant, e.job) for e in failures) == [("acme", "train"), ("globex", "sim")]
    for item in failures:
        data = item.event.data
        assert data.kind is FailureKind.GPU_ERROR and data.gpu_index == 3 and data.reason == "xid_79"
        assert data.host == host_pseudonym(SECRET, item.tenant, "h3") and data.severity is Severity.CRITICAL
    acme, globex = sorted(failures, key=lambda e: e.tenant)
    assert acme.event.data.host != globex.event.data.host, "two tenants cannot tell they share a host"


def test_predictions_carry_eta_and_confidence_and_escalate_when_close() -> None:
    def predicted(eta_minutes: float, confidence: float) -> Severity:
        signal = FailureSignal(
            kind=RawFailureKind.PREDICTED_FAILURE,
            detected_at=START,
            eta=START + timedelta(minutes=eta_minutes),
            confidence=confidence,
        )
        (event,) = _of(list(project(telemetry("h2", failures=(signal,)), FLEET["h2"], SECRET, fleet=FLEET)), "failure")
        assert event.event.data.eta == START + timedelta(minutes=eta_minutes)
        return event.event.data.severity

    assert predicted(5, 0.9) is Severity.CRITICAL
    assert predicted(60, 0.9) is Severity.WARNING
    assert predicted(5, 0.5) is Severity.WARNING


@pytest.mark.parametrize(
    ("raw", "public"),
    [("xid_79", "xid_79"), ("ecc_uncorrectable", "ecc_uncorrectable"), ("gpu-node-17 fell over", None),
     ("rack_a3_psu", None), ("xid_1234", None), (None, None)],
)
def test_only_public_failure_reasons_pass(raw: str | None, public: str | None) -> None:
    assert public_reason(raw) == public


def test_maintenance_ids_are_per_tenant_and_list_only_this_host() -> None:
    notice = MaintenanceNotice(
        notice_id="CHG-2025-0042 rack a3",
        kind=MaintenanceKind.REBOOT,
        status=MaintenanceStatus.SCHEDULED,
        not_before=START + timedelta(hours=1),
        not_after=START + timedelta(hours=2),
        early_approval=True,
    )
    projected = project(telemetry("h3", "g2", maintenance=(notice,)), FLEET["h3"], SECRET, fleet=FLEET)
    events = _of(list(projected), "maintenance")
    assert sorted(e.tenant for e in events) == ["acme", "globex"]
    ids = {e.tenant: e.event.data.notice_id for e in events}
    assert ids == {t: notice_pseudonym(SECRET, t, "CHG-2025-0042 rack a3") for t in ("acme", "globex")}
    assert ids["acme"] != ids["globex"]
    for item in events:
        assert item.event.data.hosts == (host_pseudonym(SECRET, item.tenant, "h3"),)
        assert item.event.data.early_approval is True


def test_carbon_is_region_level_and_reported_once_per_job() -> None:
    reading = CarbonReading(
        region="US-CAL-CISO",
        g_per_kwh=210.5,
        observed_at=START,
        forecast=(CarbonPoint(at=START + timedelta(hours=1), g_per_kwh=205.0),),
    )
    events = _of(_everywhere(carbon=reading), "carbon")
    assert sorted((e.tenant, e.job) for e in events) == [("acme", "solo"), ("acme", "train"), ("globex", "sim")]
    assert {e.event.data.region for e in events} == {"US-CAL-CISO"}
    assert events[0].event.data.forecast[0].g_per_kwh == 205.0


def test_hosts_without_jobs_produce_nothing() -> None:
    idle = assignment("h9", "g1")
    assert project(telemetry("h9", links=(_link("x", "g1"),)), idle, SECRET, fleet=FLEET) == ()


def test_telemetry_and_assignment_must_be_the_same_host() -> None:
    with pytest.raises(ValueError, match="h2"):
        project(telemetry("h1"), FLEET["h2"], SECRET)


def test_every_event_is_a_valid_cloudevent_on_its_tenants_subject() -> None:
    events = _everywhere(links=(_link("l", "g1"),))
    assert events
    for item in events:
        parsed = parse_event(item.event.to_json_bytes())
        assert parsed.subject == item.job
        assert item.subject == tenant_event_subject(item.tenant, parsed.data.KIND, item.job)


def test_host_down_names_the_host_by_each_tenants_pseudonym() -> None:
    events = host_down(FLEET["h3"], SECRET, detected_at=START)
    assert sorted((e.tenant, e.job) for e in events) == [("acme", "train"), ("globex", "sim")]
    for item in events:
        assert item.event.data.kind is FailureKind.HOST_DOWN and item.event.data.severity is Severity.CRITICAL
        assert item.event.data.host == host_pseudonym(SECRET, item.tenant, "h3")
        assert item.subject == f"hz.t.{item.tenant}.events.failure.{item.job}"


def test_capacity_is_bucketed_per_group_pseudonym() -> None:
    free = {"g1": 0, "g2": 5, "g3": 40}
    capacity = capacity_view("acme", SECRET, free_gpus_by_group=free, max_workers=3, as_of=START)
    assert {g.group: g.free_gpus for g in capacity.groups} == {
        locality_pseudonym(SECRET, "acme", "g1"): Availability.NONE,
        locality_pseudonym(SECRET, "acme", "g2"): Availability.SOME,
        locality_pseudonym(SECRET, "acme", "g3"): Availability.MANY,
    }
    assert "g2" not in capacity.model_dump_json().replace("g-", "")


# ---------------------------------------------------------------------------------------------------------------
# Property test. Internal names start with "zq", tenants with "tq", jobs with "jq", followed by letters g-z: none of
# these can occur by accident in field names, enum values, timestamps, hex pseudonyms or the region code, so any
# occurrence in a tenant's event is a leak. Tenant and job ids have a fixed length, so no id contains another.

_LETTERS = "ghijklmnopqrstuvwxyz"
_internal = st.text(alphabet=_LETTERS, min_size=6, max_size=12).map(lambda s: "zq" + s)
_fixed = st.text(alphabet=_LETTERS, min_size=8, max_size=8)
_PSEUDONYM_RE = re.compile(r"\b[hgm]-[0-9a-f]{16}\b")


_reason = st.none() | st.sampled_from(["xid_79", "thermal"]) | _internal | _internal.map(lambda s: s + "_xid_1")
_host_raw = st.tuples(
    st.lists(
        st.tuples(_internal, st.lists(st.integers(0, 2), min_size=1, max_size=2), st.floats(1.0, 200.0)), max_size=4
    ),
    st.lists(
        st.tuples(st.sampled_from(list(RawFailureKind)), st.none() | st.integers(0, 7), _internal, _reason), max_size=3
    ),
    st.lists(st.tuples(_internal, st.sampled_from(list(MaintenanceKind))), max_size=2),
    st.lists(_internal, min_size=1, max_size=3),
)


def _failure(kind: RawFailureKind, gpu: int | None, component: str, reason: str | None) -> FailureSignal:
    predicted = kind is RawFailureKind.PREDICTED_FAILURE
    return FailureSignal(
        kind=kind,
        gpu_index=gpu,
        component=component,
        detected_at=START,
        reason=reason,
        eta=START + timedelta(minutes=5) if predicted else None,
        confidence=0.7 if predicted else None,
    )


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, object]:
    hosts = draw(st.lists(_internal, min_size=1, max_size=5, unique=True))
    groups = draw(st.lists(_internal.filter(lambda g: g not in hosts), min_size=1, max_size=3, unique=True))
    tenants = draw(st.lists(_fixed.map(lambda s: "tq" + s), min_size=1, max_size=3, unique=True))
    job_ids = draw(st.lists(_fixed.map(lambda s: "jq" + s), min_size=len(tenants), max_size=6, unique=True))
    jobs = [(tenants[i % len(tenants)], job) for i, job in enumerate(job_ids)]
    fleet = {}
    for host in hosts:
        placed = draw(st.lists(st.sampled_from(jobs), max_size=len(jobs), unique=True))
        fleet[host] = assignment(host, draw(st.sampled_from(groups)), *placed, gpus=draw(st.integers(0, 80)))
    secret = draw(st.binary(min_size=8, max_size=32))
    names = set(hosts) | set(groups)
    per_host = {}
    for host in hosts:
        raw_links, raw_failures, raw_notices, serials = draw(_host_raw)
        links = [
            LinkCongestion(
                link=name + ":eth1/2",
                groups=tuple(dict.fromkeys(groups[i % len(groups)] for i in indices)),
                utilization=0.5,
                slowdown=slowdown,
                since=START,
            )
            for name, indices, slowdown in raw_links
        ]
        failures = [_failure(*raw) for raw in raw_failures]
        notices = [
            MaintenanceNotice(
                notice_id=notice_id,
                kind=kind,
                status=MaintenanceStatus.SCHEDULED,
                not_before=START,
                not_after=START + timedelta(hours=1),
            )
            for notice_id, kind in raw_notices
        ]
        names |= {link.link for link in links} | {f.component for f in failures if f.component}
        names |= {f.reason for f in failures if f.reason and f.reason.startswith("zq")}
        names |= {n.notice_id for n in notices} | set(serials)
        per_host[host] = telemetry(
            host,
            fleet[host].locality_group,
            gpus=tuple(
                GpuSample(index=i, serial=serial, power_w=400.0, utilization=0.5, memory_gib=40.0)
                for i, serial in enumerate(serials)
            ),
            links=tuple(links),
            failures=tuple(failures),
            maintenance=tuple(notices),
            carbon=CarbonReading(region="DE", g_per_kwh=300.0, observed_at=START),
        )
    return {"fleet": fleet, "telemetry": per_host, "secret": secret, "names": names, "tenants": tenants, "jobs": jobs}


def _all_events(world: dict[str, object]) -> list[TenantEvent]:
    """Everything any host could send: projections, the all-clears after them, and host_down reports."""
    fleet: dict[str, HostAssignment] = world["fleet"]  # type: ignore[assignment]
    secret: bytes = world["secret"]  # type: ignore[assignment]
    events: list[TenantEvent] = []
    for host, snapshot in world["telemetry"].items():  # type: ignore[attr-defined]
        projected = project(snapshot, fleet[host], secret, fleet=fleet)
        tracker = ChangeTracker()
        jobs = [(j.tenant, j.job) for j in fleet[host].jobs]
        events += tracker.changes(projected, jobs=jobs, now=START)
        events += tracker.changes([], jobs=jobs, now=START + timedelta(seconds=1))  # all-clears
        events += host_down(fleet[host], secret, detected_at=START)
    return events


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_no_internal_name_and_no_other_tenants_data_in_any_tenant_event(world: dict[str, object]) -> None:
    fleet: dict[str, HostAssignment] = world["fleet"]  # type: ignore[assignment]
    secret: bytes = world["secret"]  # type: ignore[assignment]
    names: set[str] = world["names"]  # type: ignore[assignment]
    tenants: list[str] = world["tenants"]  # type: ignore[assignment]
    jobs: list[tuple[str, str]] = world["jobs"]  # type: ignore[assignment]
    for item in _all_events(world):
        text = item.event.to_json_bytes().decode() + " " + item.subject
        leaked = [name for name in names if name in text]
        assert not leaked, f"internal names {leaked} in {text}"
        foreign = [t for t in tenants if t != item.tenant and t in text]
        foreign += [j for _, j in jobs if j != item.job and j in text]
        assert not foreign, f"other tenants' ids or jobs {foreign} in {item.tenant}'s {text}"
        assert item.subject == tenant_event_subject(item.tenant, item.event.data.KIND, item.job)
        assert item.event.subject == item.job
        job_hosts = {h for h, a in fleet.items() if any((j.tenant, j.job) == (item.tenant, item.job) for j in a.jobs)}
        allowed = {host_pseudonym(secret, item.tenant, h) for h in job_hosts}
        allowed |= {locality_pseudonym(secret, item.tenant, fleet[h].locality_group) for h in job_hosts}
        allowed |= {
            notice_pseudonym(secret, item.tenant, n.notice_id)
            for h in job_hosts
            for n in world["telemetry"][h].maintenance  # type: ignore[index]
        }
        unexpected = set(_PSEUDONYM_RE.findall(text)) - allowed
        assert not unexpected, f"pseudonyms {unexpected} are not {item.tenant}'s names for {item.job}'s hosts"
