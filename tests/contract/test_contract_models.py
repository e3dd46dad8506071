"""Payload models: cross-field rules, bounds on every input, and the privacy shape of tenant-facing ids."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from harmonaize.events import (
    Availability,
    Capacity,
    CarbonIntensity,
    Congestion,
    EventData,
    EventKind,
    EventRegistry,
    Failure,
    Maintenance,
    MaintenanceKind,
    Topology,
    UnknownEventKindError,
    bucket_for_free_gpus,
    parse_kind,
)

T0 = datetime(2025, 3, 14, 2, 0, tzinfo=UTC)
HOST, GROUP = "h-1a2b3c", "g-aa11bb"


def _fields_in(error: ValidationError) -> set[str]:
    return {".".join(str(part) for part in item["loc"]) for item in error.errors()}


# failure ---------------------------------------------------------------------------------------------------------

FAILURE_BASE: dict[str, Any] = {"host": HOST, "detected_at": T0, "severity": "critical"}


def test_predicted_failure_requires_eta_and_confidence() -> None:
    with pytest.raises(ValidationError, match="eta and confidence are required when kind is 'predicted_failure'"):
        Failure(kind="predicted_failure", **FAILURE_BASE)
    with pytest.raises(ValidationError, match="confidence is required"):
        Failure(kind="predicted_failure", eta=T0 + timedelta(minutes=5), **FAILURE_BASE)
    with pytest.raises(ValidationError, match="eta is required"):
        Failure(kind="predicted_failure", confidence=0.5, **FAILURE_BASE)
    ok = Failure(kind="predicted_failure", eta=T0 + timedelta(minutes=5), confidence=0.5, **FAILURE_BASE)
    assert ok.confidence == 0.5


@pytest.mark.parametrize("kind", ["host_down", "gpu_error", "degraded"])
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"eta": T0 + timedelta(minutes=5)}, "eta is only allowed"),
        ({"confidence": 0.9}, "confidence is only allowed"),
        ({"eta": T0 + timedelta(minutes=5), "confidence": 0.9}, "eta and confidence are only allowed"),
    ],
)
def test_other_failures_forbid_eta_and_confidence(kind: str, extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        Failure(kind=kind, **FAILURE_BASE, **extra)
    assert Failure(kind=kind, **FAILURE_BASE).eta is None


def test_prediction_eta_is_not_in_the_past_of_detection() -> None:
    with pytest.raises(ValidationError, match="eta must not be before detected_at"):
        Failure(kind="predicted_failure", eta=T0 - timedelta(seconds=1), confidence=0.5, **FAILURE_BASE)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"confidence": 1.5}, "confidence"),
        ({"confidence": -0.1}, "confidence"),
        ({"confidence": float("nan")}, "confidence"),
        ({"confidence": True}, "confidence"),
        ({"gpu_index": -1}, "gpu_index"),
        ({"gpu_index": 64}, "gpu_index"),
        ({"gpu_index": "3"}, "gpu_index"),
        ({"reason": "Xid 79 on gpu-node-17.rack-a3"}, "reason"),
        ({"reason": "x" * 49}, "reason"),
        ({"severity": "apocalyptic"}, "severity"),
        ({"host": "gpu-node-17"}, "host"),
    ],
)
def test_failure_bounds_name_the_field(override: dict[str, Any], field: str) -> None:
    values = {"kind": "predicted_failure", "eta": T0 + timedelta(minutes=5), "confidence": 0.5, **FAILURE_BASE}
    with pytest.raises(ValidationError) as caught:
        Failure(**{**values, **override})
    assert field in _fields_in(caught.value)


# maintenance -----------------------------------------------------------------------------------------------------


def _maintenance(**override: Any) -> Maintenance:
    values: dict[str, Any] = {
        "notice_id": "mnt-1",
        "kind": "reboot",
        "status": "scheduled",
        "window": {"not_before": T0, "not_after": T0 + timedelta(minutes=15)},
        "hosts": [HOST],
    }
    return Maintenance(**{**values, **override})


def test_maintenance_window_order_is_enforced() -> None:
    with pytest.raises(ValidationError, match="not_after must be at or after not_before"):
        _maintenance(window={"not_before": T0, "not_after": T0 - timedelta(seconds=1)})
    instant = _maintenance(window={"not_before": T0, "not_after": T0})
    assert instant.window.not_after == instant.window.not_before
    assert _maintenance().early_approval is False


@pytest.mark.parametrize(
    "kind",
    ["freeze", "reboot", "redeploy", "preempt", "terminate", "stop", "hibernate", "live_migrate", "retire"]
    + ["host_maintenance", "rebalance_recommendation"],
)
def test_maintenance_kinds_cover_the_clouds(kind: str) -> None:
    assert _maintenance(kind=kind).kind is MaintenanceKind(kind)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"hosts": []}, "hosts"),
        ({"hosts": [HOST] * 2}, "hosts"),
        ({"hosts": [f"h-{index:06x}" for index in range(257)]}, "hosts"),
        ({"hosts": ["node-a"]}, "hosts.0"),
        ({"notice_id": "Azure-EventId.42"}, "notice_id"),
        ({"status": "pending"}, "status"),
        ({"kind": "reimage"}, "kind"),
        ({"early_approval": "yes"}, "early_approval"),
    ],
)
def test_maintenance_bounds(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _maintenance(**override)
    assert field in _fields_in(caught.value) or f"{field}: " in str(caught.value)


def test_duplicate_maintenance_hosts_are_named() -> None:
    with pytest.raises(ValidationError, match="hosts: each host may appear once"):
        _maintenance(hosts=[HOST, HOST])


# carbon ----------------------------------------------------------------------------------------------------------


def _carbon(**override: Any) -> CarbonIntensity:
    values: dict[str, Any] = {"region": "US-CAL-CISO", "g_per_kwh": 250.0, "observed_at": T0}
    return CarbonIntensity(**{**values, **override})


def test_forecast_must_be_strictly_increasing() -> None:
    points = [{"at": T0 + timedelta(hours=h), "g_per_kwh": 200.0} for h in (1, 2, 2)]
    with pytest.raises(ValidationError, match="point 2 is not strictly after point 1"):
        _carbon(forecast=points)
    backwards = [{"at": T0 + timedelta(hours=h), "g_per_kwh": 200.0} for h in (2, 1)]
    with pytest.raises(ValidationError, match="point 1 is not strictly after point 0"):
        _carbon(forecast=backwards)
    ok = _carbon(forecast=[{"at": T0 + timedelta(hours=h), "g_per_kwh": 200.0} for h in range(1, 4)])
    assert len(ok.forecast) == 3


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"g_per_kwh": -1.0}, "g_per_kwh"),
        ({"g_per_kwh": 5000.1}, "g_per_kwh"),
        ({"g_per_kwh": float("inf")}, "g_per_kwh"),
        ({"region": "us-cal-ciso"}, "region"),
        ({"region": "DC-SJC-03/rack-7"}, "region"),
        ({"region": ""}, "region"),
        ({"forecast": [{"at": T0 + timedelta(hours=h), "g_per_kwh": 1.0} for h in range(337)]}, "forecast"),
        ({"forecast": [{"at": T0, "g_per_kwh": -5.0}]}, "forecast.0.g_per_kwh"),
        ({"observed_at": datetime(2025, 3, 14)}, "observed_at"),
    ],
)
def test_carbon_bounds(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _carbon(**override)
    assert field in _fields_in(caught.value)


# congestion ------------------------------------------------------------------------------------------------------


def _congestion(**override: Any) -> Congestion:
    values: dict[str, Any] = {"level": "moderate", "slowdown": 1.3, "scope": "inter_group", "groups": [GROUP]}
    return Congestion(**{**values, "since": T0, **override})


def test_congestion_rules() -> None:
    assert _congestion(level="none", slowdown=1.0, groups=[]).level == "none"
    with pytest.raises(ValidationError, match="slowdown must be 1.0 when level is 'none'"):
        _congestion(level="none", slowdown=1.2)
    with pytest.raises(ValidationError, match="at least one affected group"):
        _congestion(groups=[])
    with pytest.raises(ValidationError, match="expected_until must not be before since"):
        _congestion(expected_until=T0 - timedelta(seconds=1))
    with pytest.raises(ValidationError, match="each group may appear once"):
        _congestion(groups=[GROUP, GROUP])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"slowdown": 0.9}, "slowdown"),
        ({"slowdown": 100.5}, "slowdown"),
        ({"scope": "rack"}, "scope"),
        ({"level": "extreme"}, "level"),
        ({"groups": ["spine-switch-3"]}, "groups.0"),
        ({"groups": [f"g-{index:06x}" for index in range(65)]}, "groups"),
    ],
)
def test_congestion_bounds(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _congestion(**override)
    assert field in _fields_in(caught.value)


# topology --------------------------------------------------------------------------------------------------------


def _node(host: str = HOST, group: str = GROUP, **override: Any) -> dict[str, Any]:
    return {"host": host, "group": group, "gpus": 8, "gpu_class": "xlarge", **override}


def _topology(**override: Any) -> Topology:
    values: dict[str, Any] = {"nodes": [_node()], "groups": [{"group": GROUP, "intra_bandwidth": "very_high"}]}
    return Topology(**{**values, **override})


def test_topology_consistency() -> None:
    other = "g-cc22dd"
    groups = [{"group": GROUP, "intra_bandwidth": "high"}, {"group": other, "intra_bandwidth": "high"}]
    topology = _topology(
        nodes=[_node(), _node("h-4d5e6f", other), _node("h-7a8b9c")],
        groups=groups,
        links=[{"a": GROUP, "b": other, "bandwidth": "low"}],
    )
    assert topology.hosts_by_group() == {GROUP: (HOST, "h-7a8b9c"), other: ("h-4d5e6f",)}
    with pytest.raises(ValidationError, match="not listed in groups"):
        _topology(nodes=[_node(group=other)])
    with pytest.raises(ValidationError, match="each host may appear once"):
        _topology(nodes=[_node(), _node()])
    with pytest.raises(ValidationError, match="each group may appear once"):
        _topology(groups=[groups[0], groups[0]])
    with pytest.raises(ValidationError, match="appears more than once"):
        _topology(groups=groups, links=[{"a": GROUP, "b": other, "bandwidth": "low"}] * 2)
    with pytest.raises(ValidationError, match="appears more than once"):
        _topology(
            groups=groups,
            links=[{"a": GROUP, "b": other, "bandwidth": "low"}, {"a": other, "b": GROUP, "bandwidth": "low"}],
        )
    with pytest.raises(ValidationError, match="two different groups"):
        _topology(links=[{"a": GROUP, "b": GROUP, "bandwidth": "low"}])
    with pytest.raises(ValidationError, match="not listed in groups"):
        _topology(links=[{"a": GROUP, "b": other, "bandwidth": "low"}])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"nodes": []}, "nodes"),
        ({"nodes": [_node(gpus=65)]}, "nodes.0.gpus"),
        ({"nodes": [_node(gpus=-1)]}, "nodes.0.gpus"),
        ({"nodes": [_node(gpu_class="H100-SXM5-80GB")]}, "nodes.0.gpu_class"),
        ({"nodes": [_node(host="dgx-a100-017")]}, "nodes.0.host"),
        ({"nodes": [_node(group="rack-a3")]}, "nodes.0.group"),
        ({"nodes": [_node(switch="leaf-12")]}, "nodes.0.switch"),
        ({"nodes": [_node(f"h-{index:06x}") for index in range(257)]}, "nodes"),
    ],
)
def test_topology_bounds(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _topology(**override)
    assert field in _fields_in(caught.value)


# capacity --------------------------------------------------------------------------------------------------------


def test_capacity_buckets_and_bounds() -> None:
    assert [bucket_for_free_gpus(n) for n in (0, 1, 3, 4, 15, 16, 1000)] == [
        Availability.NONE,
        Availability.FEW,
        Availability.FEW,
        Availability.SOME,
        Availability.SOME,
        Availability.MANY,
        Availability.MANY,
    ]
    with pytest.raises(ValueError):
        bucket_for_free_gpus(-1)
    capacity = Capacity(groups=[{"group": GROUP, "free_gpus": "some"}], max_workers=4, as_of=T0)
    assert capacity.groups[0].free_gpus is Availability.SOME
    overrides: list[tuple[dict[str, Any], str]] = [
        ({"max_workers": -1}, "max_workers"),
        ({"max_workers": 4097}, "max_workers"),
        ({"groups": [{"group": GROUP, "free_gpus": 12}]}, "groups.0.free_gpus"),
        ({"groups": [{"group": "pod-7", "free_gpus": "few"}]}, "groups.0.group"),
    ]
    for override, field in overrides:
        with pytest.raises(ValidationError) as caught:
            Capacity(**{"groups": [], "max_workers": 4, "as_of": T0, **override})
        assert field in _fields_in(caught.value)
    with pytest.raises(ValidationError, match="each group may appear once"):
        Capacity(groups=[{"group": GROUP, "free_gpus": "few"}] * 2, max_workers=1, as_of=T0)


# shared rules ----------------------------------------------------------------------------------------------------

ALL_MODELS: list[type[EventData]] = [Topology, Congestion, Failure, Maintenance, CarbonIntensity, Capacity]


@pytest.mark.parametrize("model", ALL_MODELS)
def test_models_are_frozen_closed_and_versioned(model: type[EventData]) -> None:
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid"
    assert model.event_type() == f"io.harmonaize.{model.KIND.value}.v{model.VERSION}"


def _unbounded_nodes(node: object, path: str) -> list[str]:
    """Paths in a JSON schema where a string, number or array has no bound."""
    found: list[str] = []
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "string" and not {"pattern", "maxLength", "enum", "const", "format"} & node.keys():
            found.append(path)
        if kind == "array" and "maxItems" not in node:
            found.append(path)
        if kind in {"number", "integer"} and not (
            {"minimum", "exclusiveMinimum"} & node.keys() and {"maximum", "exclusiveMaximum"} & node.keys()
        ):
            found.append(path)
        for key, child in node.items():
            found.extend(_unbounded_nodes(child, f"{path}.{key}"))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found.extend(_unbounded_nodes(child, f"{path}[{index}]"))
    return found


@pytest.mark.parametrize("model", ALL_MODELS)
def test_every_string_number_and_list_is_bounded(model: type[EventData]) -> None:
    """Untrusted input must not be able to push unbounded strings, numbers or lists into a control loop."""
    assert _unbounded_nodes(model.model_json_schema(), model.__name__) == []


def test_frozen_instances_refuse_mutation() -> None:
    failure = Failure(kind="host_down", **FAILURE_BASE)
    with pytest.raises(ValidationError):
        failure.host = "h-000000"  # type: ignore[misc]


def test_kind_parsing() -> None:
    assert parse_kind("failure") is EventKind.FAILURE
    assert parse_kind(EventKind.CARBON) is EventKind.CARBON
    with pytest.raises(UnknownEventKindError, match="known kinds"):
        parse_kind("FAILURE")


def test_registries_are_immutable_and_extendable_by_copy() -> None:
    from harmonaize.events import DEFAULT_REGISTRY

    class FailureV2(Failure):
        KIND = EventKind.FAILURE
        VERSION = 2

    extended = DEFAULT_REGISTRY.with_models(FailureV2)
    assert extended.versions("failure") == (1, 2)
    assert DEFAULT_REGISTRY.versions("failure") == (1,)
    assert "io.harmonaize.failure.v2" in extended
    assert "io.harmonaize.failure.v2" not in DEFAULT_REGISTRY
    with pytest.raises(ValueError, match="two models"):
        EventRegistry([Failure, FailureV2, type("Clash", (FailureV2,), {"KIND": EventKind.FAILURE, "VERSION": 2})])


def test_subclass_without_version_is_refused() -> None:
    with pytest.raises(TypeError, match="VERSION"):

        class Broken(EventData):
            KIND = EventKind.FAILURE


@pytest.mark.parametrize(
    "host",
    [
        "h-1a2b3c\n", "H-1A2B3C", "h-1A2B3C", "h-1a2b3", "h-" + "a" * 33, "h-1a2b3g", "h-1a2b3\u0441", "g-1a2b3c",
        "node-7",
    ],
)
def test_host_pseudonyms_have_exactly_the_tenant_facing_shape(host: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Failure(kind="host_down", **{**FAILURE_BASE, "host": host})
    assert "host" in _fields_in(caught.value)


def test_negotiation_host_names_have_the_shape_events_give_hosts() -> None:
    from harmonaize import negotiation
    from harmonaize.events import fields

    assert negotiation.HOST_PSEUDONYM_PATTERN == fields.HOST_PSEUDONYM_PATTERN
