"""A tenant's durable event consumers (the provider creates them; the tenant pulls and acks)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import BrokerDep, CurrentTenant
from api.schemas import EventConsumerPublic, EventConsumerUpdate
from api.services.event_consumers import ensure_event_consumer
from harmonaize.ids import ConsumerName

router = APIRouter(tags=["events"])


@router.put("/event-consumers/{name}")
async def put_event_consumer(
    name: ConsumerName, body: EventConsumerUpdate, tenant: CurrentTenant, broker: BrokerDep
) -> EventConsumerPublic:
    """Create or update a durable pull consumer on the caller's events stream; idempotent."""
    consumer = await ensure_event_consumer(
        broker, tenant_id=tenant.id, name=name, kinds=body.kinds, jobs=body.jobs, ack_wait_s=body.ack_wait_s,
        position=body.position, start_after=body.start_after, stream_created=body.stream_created,
    )
    return EventConsumerPublic(
        name=consumer.name,
        stream=consumer.stream,
        js_api_prefix=consumer.js_api_prefix,
        filter_subjects=consumer.filter_subjects,
        ack_wait_s=consumer.ack_wait_s,
        position=consumer.position,
        stream_created=consumer.stream_created,
    )
