"""The events a tenant can receive: versioned payload models, the CloudEvents envelope and the type registry.

Import from here (`from harmonaize.events import Failure, make_event, parse_event`); the submodules are an
implementation detail of "one kind per module". Only stdlib and pydantic are used, so a tenant controller or a
training script can depend on this package without the provider's stack.
"""

from harmonaize.events.base import EVENT_TYPE_PREFIX, ContractModel, EventData, event_type_name, split_event_type
from harmonaize.events.capacity import Availability, Capacity, GroupCapacity, bucket_for_free_gpus
from harmonaize.events.carbon import CarbonIntensity, ForecastPoint
from harmonaize.events.congestion import Congestion, CongestionLevel, CongestionScope
from harmonaize.events.directive import DirectiveState, DirectiveUpdate
from harmonaize.events.envelope import (
    CONTENT_TYPE,
    DATA_CONTENT_TYPE,
    MAX_EVENT_BYTES,
    SPEC_VERSION,
    CloudEvent,
    ExtensionValue,
    make_event,
    parse_event,
    parse_event_as,
)
from harmonaize.events.errors import EventError, InvalidEventError, UnknownEventTypeError
from harmonaize.events.failure import Failure, FailureKind, Severity
from harmonaize.events.fields import (
    GROUP_PSEUDONYM_PATTERN,
    HOST_PSEUDONYM_PATTERN,
    GroupPseudonym,
    HostPseudonym,
    NoticeId,
    UtcDatetime,
    format_rfc3339,
    is_group_pseudonym,
    is_host_pseudonym,
    parse_rfc3339,
)
from harmonaize.events.job import JobUpdate
from harmonaize.events.kinds import EventKind, UnknownEventKindError, parse_kind
from harmonaize.events.maintenance import Maintenance, MaintenanceKind, MaintenanceStatus, MaintenanceWindow
from harmonaize.events.negotiation import NegotiationUpdate
from harmonaize.events.registry import DEFAULT_REGISTRY, EventRegistry
from harmonaize.events.sources import CONTROL_PLANE_SOURCE, agent_source
from harmonaize.events.topology import BandwidthClass, GpuClass, GroupLink, LocalityGroup, Topology, TopologyNode

__all__ = [
    "CONTENT_TYPE",
    "CONTROL_PLANE_SOURCE",
    "DATA_CONTENT_TYPE",
    "DEFAULT_REGISTRY",
    "EVENT_TYPE_PREFIX",
    "GROUP_PSEUDONYM_PATTERN",
    "HOST_PSEUDONYM_PATTERN",
    "MAX_EVENT_BYTES",
    "SPEC_VERSION",
    "Availability",
    "BandwidthClass",
    "Capacity",
    "CarbonIntensity",
    "CloudEvent",
    "Congestion",
    "DirectiveState",
    "DirectiveUpdate",
    "CongestionLevel",
    "CongestionScope",
    "ContractModel",
    "EventData",
    "EventError",
    "EventKind",
    "EventRegistry",
    "ExtensionValue",
    "Failure",
    "FailureKind",
    "ForecastPoint",
    "GpuClass",
    "GroupCapacity",
    "GroupLink",
    "GroupPseudonym",
    "HostPseudonym",
    "InvalidEventError",
    "JobUpdate",
    "LocalityGroup",
    "Maintenance",
    "MaintenanceKind",
    "MaintenanceStatus",
    "MaintenanceWindow",
    "NoticeId",
    "Severity",
    "NegotiationUpdate",
    "Topology",
    "TopologyNode",
    "UnknownEventKindError",
    "UnknownEventTypeError",
    "UtcDatetime",
    "agent_source",
    "bucket_for_free_gpus",
    "event_type_name",
    "format_rfc3339",
    "is_group_pseudonym",
    "is_host_pseudonym",
    "make_event",
    "parse_event",
    "parse_event_as",
    "parse_kind",
    "parse_rfc3339",
    "split_event_type",
]
