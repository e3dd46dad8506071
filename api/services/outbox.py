"""The transactional outbox: messages are written in the same transaction as the decision they announce.

Publishing to NATS inside a database transaction would either publish decisions that then roll back, or commit
decisions whose announcement is lost when the process dies before publishing. Instead a use case adds outbox rows
next to its other writes; they commit or vanish together, and `outbox_relay` delivers committed rows afterwards
(at least once: consumers dedup by the message id, and JetStream itself drops retries with the same `Nats-Msg-Id`).

Rows are queued on the session and written with the transaction's other queued rows as it commits
(`api.commit_inserts`), so a use case pays no statement of its own however many messages it announces; a
transaction that does not commit writes none.

Two topics: `tenant_event` (a CloudEvent for the tenant's stream, msg id = the CloudEvent id) and `desired_state`
(a host's full `HostAssignment` for the desired-state KV bucket, keyed by `host_key`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncSession

from api.commit_inserts import queue_insert
from api.log_context import current_traceparent
from api.models import OutboxMessage, OutboxTopic
from harmonaize.desired_state import HostAssignment, host_key
from harmonaize.events import CONTROL_PLANE_SOURCE, EventData, make_event
from harmonaize.subjects import tenant_event_subject
from harmonaize.timeids import uuid7

_OUTBOX = cast("Table", OutboxMessage.__table__)


def tenant_event_row(*, tenant_id: str, job_id: str, data: EventData, now: datetime) -> dict[str, Any]:
    """The outbox row (column values) that publishes `data` as a CloudEvent about `job_id` on the tenant's own
    subject for its kind.

    Inside a request that carried a W3C traceparent, the event carries it too (the relay copies it into the NATS
    message's `traceparent` header), so the tenant's trace continues into the events its request caused.
    """
    event = make_event(
        data, source=CONTROL_PLANE_SOURCE, subject=job_id, time=now, traceparent=current_traceparent()
    )
    return {
        "topic": OutboxTopic.TENANT_EVENT,
        "subject": tenant_event_subject(tenant_id, data.KIND, job_id),
        "payload": event.to_json_bytes(),
        "msg_id": event.id,
        "created_at": now,
        "attempts": 0,
    }


def enqueue_tenant_event(session: AsyncSession, *, tenant_id: str, job_id: str, data: EventData, now: datetime) -> None:
    """Queue `data` for the tenant (`tenant_event_row`): written with the transaction's other outbox rows at commit."""
    queue_insert(session, _OUTBOX, tenant_event_row(tenant_id=tenant_id, job_id=job_id, data=data, now=now))


def enqueue_desired_state(
    session: AsyncSession, assignment: HostAssignment, *, now: datetime, payload: bytes | None = None
) -> None:
    """Queue a host's complete assignment (level-triggered: the agent converges to it, whatever it saw before).

    `payload`: the assignment's JSON, when the caller has it already (`api.services.assigned_jobs`).
    """
    queue_insert(session, _OUTBOX, {
        "topic": OutboxTopic.DESIRED_STATE,
        "subject": host_key(assignment.host),
        "payload": assignment.model_dump_json().encode() if payload is None else payload,
        "msg_id": uuid7(),
        "created_at": now,
        "attempts": 0,
    })

