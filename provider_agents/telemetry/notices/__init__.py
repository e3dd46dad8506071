"""Real cloud maintenance and preemption notices as telemetry: pollers for the clouds' metadata services.

Each channel polls one cloud's documented endpoints in the background and keeps its latest *valid* view as
`MaintenanceNotice`s (and, where a notice implies one, a `FailureSignal`), with the cloud's lead times kept; a 503, a
timeout or a bad document leaves the view as it was. `NoticeOverlay` adds the channels' views (and those of any other
`SignalChannel`, such as NVSentinel's health events) to a base source's samples. The mapping of each cloud's notice
to our `MaintenanceKind` is the table in `harmonaize.events.maintenance`.

- `AzureScheduledEvents`: Scheduled Events (Freeze, Reboot, Redeploy, Preempt, Terminate), with early approval.
- `AwsInstanceNotices`: IMDSv2 Spot interruptions, rebalance recommendations, scheduled events, Capacity Block end.
- `GcpMaintenanceNotices`: `maintenance-event` (long-polled), `preempted`, `upcoming-maintenance`.
"""

from provider_agents.telemetry.notices.aws import AwsInstanceNotices
from provider_agents.telemetry.notices.azure import AzureScheduledEvents
from provider_agents.telemetry.notices.channel import (
    ESTIMATED_DURATION,
    BadDocument,
    EarlyStartChannel,
    NoticeChannel,
    NoticeError,
    NoticeView,
    SignalChannel,
)
from provider_agents.telemetry.notices.gcp import GcpMaintenanceNotices
from provider_agents.telemetry.notices.http import ChannelHealth, FetchError, PollingChannel
from provider_agents.telemetry.notices.overlay import NoticeOverlay

__all__ = [
    "ESTIMATED_DURATION",
    "AwsInstanceNotices",
    "AzureScheduledEvents",
    "BadDocument",
    "ChannelHealth",
    "EarlyStartChannel",
    "FetchError",
    "GcpMaintenanceNotices",
    "NoticeChannel",
    "NoticeError",
    "NoticeOverlay",
    "NoticeView",
    "PollingChannel",
    "SignalChannel",
]
