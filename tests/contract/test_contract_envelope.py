"""The CloudEvents envelope: every event type round-trips, the official SDK agrees, bad input is named."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkCloudEvent
from cloudevents.v1.http import from_http as legacy_from_http

from harmonaize.events import (
    CONTENT_TYPE,
    DEFAULT_REGISTRY,
    BandwidthClass,
    Capacity,
    CarbonIntensity,
    CloudEvent,
    Congestion,
    DirectiveState,
    DirectiveUpdate,
    EventData,
    EventError,
    EventKind,
    Failure,
    ForecastPoint,
    GpuClass,
    GroupCapacity,
    GroupLink,
    InvalidEventError,
    JobUpdate,
    LocalityGroup,
    Maintenance,
    MaintenanceWindow,
    NegotiationUpdate,
    Topology,
    TopologyNode,
    UnknownEventTypeError,
    agent_source,
    make_event,
    parse_event,
    parse_event_as,
)
from harmonaize.ids import InvalidIdError
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationState, Offer, OfferOption
from harmonaize.timeids import is_uuid7

T0 = datetime(2025, 3, 14, 1, 59, 26, 535897, tzinfo=UTC)
HOST_A, HOST_B, HOST_C = "h-1a2b3c", "h-4d5e6f", "h-0a0b0c0d"
GROUP_1, GROUP_2 = "g-aa11bb", "g-cc22dd"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _topology() -> Topology:
    return Topology(
        nodes=[
            TopologyNode(host=HOST_A, group=GROUP_1, gpus=8, gpu_class=GpuClass.XLARGE),
            TopologyNode(host=HOST_B, group=GROUP_1, gpus=8, gpu_class=GpuClass.XLARGE),
            TopologyNode(host=HOST_C, group=GROUP_2, gpus=4, gpu_class=GpuClass.LARGE),
        ],
        groups=[
            LocalityGroup(group=GROUP_1, intra_bandwidth=BandwidthClass.VERY_HIGH),
            LocalityGroup(group=GROUP_2, intra_bandwidth=BandwidthClass.HIGH),
        ],
        links=[GroupLink(a=GROUP_1, b=GROUP_2, bandwidth=BandwidthClass.MEDIUM)],
    )


def _congestion() -> Congestion:
    return Congestion(
        level="high",
        slowdown=1.8,
        scope="inter_group",
        groups=[GROUP_1, GROUP_2],
        since=T0,
        expected_until=T0 + timedelta(minutes=20),
    )


def _failure() -> Failure:
    return Failure(kind="gpu_error", host=HOST_B, gpu_index=3, detected_at=T0, severity="critical", reason="xid_79")


def _predicted_failure() -> Failure:
    return Failure(
        kind="predicted_failure",
        host=HOST_A,
        detected_at=T0,
        severity="warning",
        eta=T0 + timedelta(minutes=10),
        confidence=0.87,
    )


def _maintenance() -> Maintenance:
    return Maintenance(
        notice_id="mnt-2025-0042",
        kind="live_migrate",
        status="scheduled",
        window=MaintenanceWindow(not_before=T0 + timedelta(hours=1), not_after=T0 + timedelta(hours=2)),
        hosts=[HOST_A, HOST_C],
        early_approval=True,
    )


def _carbon() -> CarbonIntensity:
    return CarbonIntensity(
        region="US-CAL-CISO",
        g_per_kwh=231.5,
        observed_at=T0,
        forecast=[ForecastPoint(at=T0 + timedelta(hours=hour), g_per_kwh=231.5 - 20 * hour) for hour in range(1, 6)],
    )


def _capacity() -> Capacity:
    return Capacity(
        groups=[GroupCapacity(group=GROUP_1, free_gpus="few"), GroupCapacity(group=GROUP_2, free_gpus="none")],
        max_workers=3,
        as_of=T0,
    )


def _negotiation() -> NegotiationUpdate:
    options = (
        OfferOption(workers=3, reason="3 of 4 workers are free now"),
        OfferOption(workers=4, start_at=T0 + timedelta(hours=2), expected_carbon_g_per_kwh=210.0,
                    reason="4 workers from 02:00 when carbon is forecast low"),
    )
    return NegotiationUpdate(
        negotiation_id="0192f0c1-7a2b-7c3d-8e4f-5a6b7c8d9e0f",
        kind=NegotiationKind.SCALE,
        state=NegotiationState.OFFERED,
        round=2,
        offer=Offer(options=options, expires_at=T0 + timedelta(minutes=5)),
        at=T0,
    )


def _directive() -> DirectiveUpdate:
    return DirectiveUpdate(
        version=3,
        state=DirectiveState.REFUSED,
        checkpoint_requests=1,
        compression=Compression.POWERSGD,
        powersgd_rank=8,
        reason="congestion on the job's inter-group links",
        refusals=("powersgd_rank 8 is above the allowed maximum 4",),
        step=120,
        at=T0,
    )


def _job() -> JobUpdate:
    return JobUpdate(epoch=4, world_size=3, parallel_plan=ParallelPlan.HSDP, step=140, resumed_from_step=140, at=T0)


SAMPLES: dict[str, Callable[[], EventData]] = {
    "topology": _topology,
    "congestion": _congestion,
    "failure": _failure,
    "predicted_failure": _predicted_failure,
    "maintenance": _maintenance,
    "carbon": _carbon,
    "capacity": _capacity,
    "negotiation": _negotiation,
    "directive": _directive,
    "job": _job,
}


def _event(data: EventData, **overrides: Any) -> CloudEvent[Any]:
    return make_event(data, source=agent_source(HOST_A), subject="job-1", time=T0, **overrides)


def test_samples_cover_every_registered_type() -> None:
    covered = {factory().event_type() for factory in SAMPLES.values()}
    assert covered == set(DEFAULT_REGISTRY.types)
    assert {model.KIND for model in DEFAULT_REGISTRY} == set(EventKind)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_through_json_bytes(name: str) -> None:
    data = SAMPLES[name]()
    event = _event(data, traceparent=TRACEPARENT, extensions={"region": "us-west", "attempt": 2, "replay": False})
    body = event.to_json_bytes()
    for raw in (body, body.decode(), json.loads(body)):
        parsed = parse_event(raw)
        assert parsed == event
        assert type(parsed.data) is type(data)
        assert parsed.extensions == {"region": "us-west", "attempt": 2, "replay": False}
    assert parse_event_as(body, type(data)) == event


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_official_sdk_reads_our_events(name: str) -> None:
    event = _event(SAMPLES[name](), traceparent=TRACEPARENT, extensions={"attempt": 2})
    body = event.to_json_bytes()
    expected_data = json.loads(body)["data"]

    sdk_event = from_http(HTTPMessage(headers={"content-type": CONTENT_TYPE}, body=body), JSONFormat())
    assert sdk_event.get_specversion() == "1.0"
    assert sdk_event.get_id() == event.id
    assert sdk_event.get_type() == event.type
    assert sdk_event.get_source() == event.source
    assert sdk_event.get_subject() == event.subject
    assert sdk_event.get_time() == event.time
    assert sdk_event.get_datacontenttype() == "application/json"
    assert sdk_event.get_extension("traceparent") == TRACEPARENT
    assert sdk_event.get_extension("attempt") == 2
    assert sdk_event.get_data() == expected_data

    legacy = legacy_from_http(headers={"content-type": CONTENT_TYPE}, data=body)
    assert (legacy["id"], legacy["type"], legacy["source"], legacy["subject"]) == (
        event.id,
        event.type,
        event.source,
        event.subject,
    )
    assert legacy.data == expected_data


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_we_read_what_the_official_sdk_writes(name: str) -> None:
    event = _event(SAMPLES[name]())
    wire = event.to_json_dict()
    data = wire.pop("data")
    attributes = {**wire, "time": event.time}
    sdk_body = JSONFormat().write(SdkCloudEvent(attributes, data))
    assert parse_event(sdk_body) == event


def test_defaults_id_time_and_type() -> None:
    before = datetime.now(UTC)
    event = make_event(_failure(), source="/hz/provider/control-plane", subject="job-1")
    assert is_uuid7(event.id)
    assert event.type == "io.harmonaize.failure.v1"
    assert event.specversion == "1.0"
    assert event.datacontenttype == "application/json"
    assert before <= event.time <= datetime.now(UTC)
    wire = json.loads(event.to_json_bytes())
    assert wire["time"].endswith("Z")
    assert "dataschema" not in wire and "traceparent" not in wire


def test_type_must_match_the_data_model() -> None:
    with pytest.raises(ValueError, match="does not match the data model"):
        CloudEvent[Failure](source="/x", subject="job-1", type="io.harmonaize.carbon.v1", data=_failure())


def test_envelope_is_frozen() -> None:
    event = _event(_failure())
    with pytest.raises(ValueError):
        event.subject = "job-2"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("event_type", "message"),
    [
        ("io.harmonaize.failure.v2", "unsupported version v2 of 'failure'"),
        ("io.harmonaize.failure.v0", "io.harmonaize.<kind>.v<version>"),
        ("io.harmonaize.weather.v1", "unknown kind 'weather'"),
        ("com.example.failure.v1", "io.harmonaize.<kind>.v<version>"),
        ("io.harmonaize.failure", "io.harmonaize.<kind>.v<version>"),
        ("", "io.harmonaize.<kind>.v<version>"),
        (17, "must be a string"),
    ],
)
def test_unknown_types_and_versions_are_refused(event_type: object, message: str) -> None:
    wire = _event(_failure()).to_json_dict()
    wire["type"] = event_type
    with pytest.raises(UnknownEventTypeError, match=message):
        parse_event(wire)


def test_parse_event_as_refuses_another_type() -> None:
    with pytest.raises(UnknownEventTypeError, match="expected io.harmonaize.carbon.v1"):
        parse_event_as(_event(_failure()).to_json_bytes(), CarbonIntensity)


def _mutated(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    wire = _event(_predicted_failure()).to_json_dict()
    change(wire)
    return wire


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda w: w["data"].update(confidence=1.5), "data.confidence"),
        (lambda w: w["data"].update(confidence="0.5"), "data.confidence"),
        (lambda w: w["data"].update(gpu_index=64), "data.gpu_index"),
        (lambda w: w["data"].update(host="gpu-node-17"), "data.host"),
        (lambda w: w["data"].update(unexpected=1), "data.unexpected"),
        (lambda w: w["data"].pop("severity"), "data.severity"),
        (lambda w: w.update(subject="job.1"), "subject"),
        (lambda w: w.update(subject="Job-1"), "subject"),
        (lambda w: w.pop("subject"), "subject"),
        (lambda w: w.pop("source"), "source"),
        (lambda w: w.update(source=""), "source"),
        (lambda w: w.update(source="/has space"), "source"),
        (lambda w: w.update(id=""), "id"),
        (lambda w: w.update(id="a b"), "id"),
        (lambda w: w.update(time="2025-03-14 01:59:26"), "time"),
        (lambda w: w.update(time="2025-03-14T01:59:26"), "time"),
        (lambda w: w.update(time=1741917566), "time"),
        (lambda w: w.update(datacontenttype="text/plain"), "datacontenttype"),
        (lambda w: w.update(dataschema="not a uri"), "dataschema"),
        (lambda w: w.update(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"), "traceparent"),
        (lambda w: w.update(traceparent="00-00000000000000000000000000000000-00f067aa0ba902b7-01"), "traceparent"),
        (lambda w: w.update(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"), "traceparent"),
        (lambda w: w.update(traceparent="ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), "traceparent"),
        (lambda w: w.update(traceparent="00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"), "traceparent"),
        (lambda w: w.update(specversion="0.3"), "specversion"),
        (lambda w: w.pop("specversion"), "specversion"),
        (lambda w: w.pop("type"), "type"),
        (lambda w: w.update(Bad_Name="x"), "Bad_Name"),
        (lambda w: w.update(toolongextensionname1="x"), "toolongextensionname1"),
        (lambda w: w.update(data_base64="AAAA"), "data_base64"),
        (lambda w: w.update(nested={"a": 1}), "nested"),
        (lambda w: w.update(nothing=None), "nothing"),
        (lambda w: w.update(ratio=0.5), "ratio"),
        (lambda w: w.update(big=2**31), "big"),
    ],
)
def test_bad_input_is_refused_naming_the_field(change: Callable[[dict[str, Any]], None], field: str) -> None:
    wire = _mutated(change)
    with pytest.raises(EventError) as caught:
        parse_event(json.dumps(wire))
    assert field in str(caught.value)
    if isinstance(caught.value, InvalidEventError):
        assert field in caught.value.fields


def test_confidence_above_one_names_the_field() -> None:
    wire = _mutated(lambda w: w["data"].update(confidence=1.5))
    with pytest.raises(InvalidEventError) as caught:
        parse_event(wire)
    assert caught.value.fields == ("data.confidence",)
    assert "data.confidence" in str(caught.value)
    assert "1.5" in str(caught.value)


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1, 2]", b'"a string"', b"\xff\xfe", b"{" + b" " * (1024 * 1024) + b"}"],
)
def test_undecodable_bodies_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidEventError):
        parse_event(raw)


def test_future_traceparent_versions_may_carry_more_fields() -> None:
    future = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-abcdef"
    assert parse_event(_event(_failure(), traceparent=future).to_json_bytes()).traceparent == future


def test_nanosecond_timestamps_are_accepted_and_truncated() -> None:
    wire = _event(_failure()).to_json_dict()
    wire["time"] = "2025-03-14T03:59:26.535897932+02:00"
    assert parse_event(wire).time == T0


def test_make_event_validates_the_subject_and_names_it() -> None:
    with pytest.raises(InvalidEventError) as caught:
        make_event(_failure(), source="/x", subject="acme.>")
    assert caught.value.fields == ("subject",)
    assert isinstance(caught.value.__cause__, ValueError)


def test_make_event_refuses_extensions_that_shadow_core_attributes() -> None:
    with pytest.raises(InvalidEventError, match="core attribute"):
        make_event(_failure(), source="/x", subject="job-1", extensions={"type": "x"})


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(InvalidEventError, match="time"):
        make_event(_failure(), source="/x", subject="job-1", time=datetime(2025, 1, 1))


def test_agent_source_accepts_only_pseudonyms() -> None:
    assert agent_source(HOST_A) == "/hz/provider/agent/h-1a2b3c"
    with pytest.raises(ValueError):
        agent_source("gpu-node-17")


def test_invalid_id_error_is_what_subject_validation_reports() -> None:
    with pytest.raises(InvalidEventError) as caught:
        make_event(_failure(), source="/x", subject="\u0430cme")
    assert isinstance(caught.value.__cause__, ValueError)
    assert "invalid job id" in str(caught.value)
    assert issubclass(InvalidIdError, ValueError)
