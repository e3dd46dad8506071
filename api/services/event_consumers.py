"""Durable event consumers, created by the provider on a tenant's behalf.

Tenants cannot create JetStream consumers themselves (a push consumer could deliver into another tenant's subjects;
see broker_config/render.py), so the control plane does it: the tenant names the consumer and, optionally, the event
kinds and jobs it wants; the filters are built here from validated ids and always lie inside the tenant's slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product

from api.services.errors import BrokerUnavailableError
from broker_config.accounts import EventConsumer, TenantBroker
from broker_config.server import BrokerError
from broker_config.streams import ConsumerPosition
from harmonaize.events import EventKind
from harmonaize.subjects import tenant_events_filter, tenant_slice


def consumer_filters(tenant_id: str, *, kinds: Sequence[EventKind], jobs: Sequence[str]) -> list[str]:
    """No kinds and no jobs: the tenant's whole slice (events, directives, outcomes); otherwise events only."""
    if not kinds and not jobs:
        return [tenant_slice(tenant_id)]
    kind_choices: Sequence[EventKind | None] = kinds or [None]  # None: any kind (or, below, any job)
    job_choices: Sequence[str | None] = jobs or [None]
    return [tenant_events_filter(tenant_id, kind=kind, job=job) for kind, job in product(kind_choices, job_choices)]


async def ensure_event_consumer(
    broker: TenantBroker,
    *,
    tenant_id: str,
    name: str,
    kinds: Sequence[EventKind],
    jobs: Sequence[str],
    ack_wait_s: float,
    position: ConsumerPosition = "broker",
    start_after: int | None = None,
    stream_created: str | None = None,
) -> EventConsumer:
    filters = consumer_filters(tenant_id, kinds=kinds, jobs=jobs)
    try:
        return await broker.ensure_consumer(
            tenant_id, name, filter_subjects=filters, ack_wait_s=ack_wait_s, position=position,
            start_after=start_after, stream_created=stream_created,
        )
    except BrokerError as exc:
        raise BrokerUnavailableError(str(exc)) from exc
