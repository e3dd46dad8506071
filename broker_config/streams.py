"""The JetStream streams and consumers HarmonAIze relies on, defined once.

Each tenant's events live in one provider-side stream, `HZ_T_<tenant>` over `hz.t.<tenant>.>`; a PubAck from it means
the event is stored where its tenant reads it. Tenants read through pull consumers the provider creates for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from broker_config.render import tenant_stream_name
from harmonaize.ids import validate_id
from harmonaize.subjects import TENANT_ROOT, tenant_slice

EVENT_RETENTION_S = 7 * 24 * 3600.0
DUPLICATE_WINDOW_S = 120.0
TENANT_STREAM_MAX_BYTES = 128 << 20
"""A tenant stream's quota (`HZ_TENANT_STREAM_MAX_BYTES`). nats-server reserves each stream's max_bytes against its
JetStream storage when the stream is created, so the sum over tenants must fit the broker's store: with 1 GiB each,
51 tenants filled a 69 GB disk's default limit (75 %) here and the 52nd was refused. 128 MiB holds ~300,000 events
of ~400 B, hours of history at a tenant's usual rate; the oldest go first when it is full."""
ACK_WAIT_S = 30.0
"""Default time before an unacknowledged event is redelivered (a crashed reader's events come back after it)."""
ACK_WAIT_BOUNDS_S = (1.0, 600.0)

ConsumerPosition = Literal["broker", "reader"]
"""Who keeps a consumer's position (its ack point) across a broker restart.

* "broker": nats-server keeps the consumer's state on disk. It rewrites that file (a temp file, fsync'd, renamed) up
  to 10 times a second per consumer while events flow: at 100 tenants' consumers, ~40 % of the broker's CPU.
* "reader": the consumer's state lives in the broker's memory only (replicated in a cluster), so it is gone when the
  whole broker restarts; the reader records the stream sequence below which everything is acked (the broker's ack
  floor) beside the events it handled, and asks for the consumer again from just after it (`start_after`), as a
  Kafka consumer that keeps its offsets in its own database does. What it handled since the last record comes
  again, which its de-duplication absorbs."""
CONSUMER_POSITIONS: tuple[ConsumerPosition, ...] = ("broker", "reader")


class ConsumerFilterError(ValueError):
    """A consumer filter that would reach outside the tenant's slice."""


def tenant_events_stream(
    tenant: str, *, replicas: int = 1, max_bytes: int = TENANT_STREAM_MAX_BYTES
) -> StreamConfig:
    return StreamConfig(
        name=tenant_stream_name(tenant),
        subjects=[tenant_slice(tenant)],
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=EVENT_RETENTION_S,
        max_bytes=max_bytes,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


def check_filter_in_slice(tenant: str, subject: str) -> str:
    """Return `subject` if it names only subjects of `tenant`'s slice, else raise ConsumerFilterError."""
    prefix = [*TENANT_ROOT.split("."), validate_id("tenant", tenant)]
    tokens = subject.split(".")
    if tokens[:3] != prefix or len(tokens) < 4 or any(not t or " " in t for t in tokens):
        raise ConsumerFilterError(f"filter {subject!r} is not inside the tenant's slice {tenant_slice(tenant)!r}")
    if ">" in tokens[:-1]:
        raise ConsumerFilterError(f"filter {subject!r}: '>' may only be the last token")
    return subject


def tenant_pull_consumer(
    tenant: str,
    name: str,
    *,
    filter_subjects: Sequence[str] = (),
    max_ack_pending: int = 1000,
    ack_wait_s: float = ACK_WAIT_S,
    position: ConsumerPosition = "broker",
    start_after: int | None = None,
) -> ConsumerConfig:
    """A durable pull consumer on a tenant's stream; explicit acks, so a restarted reader resumes at its ack point.

    `position` says who keeps that ack point across a broker restart (see `ConsumerPosition`); `start_after` makes a
    new consumer deliver from the next stream sequence instead of from the stream's start.
    """
    filters = [check_filter_in_slice(tenant, f) for f in filter_subjects] or [tenant_slice(tenant)]
    low, high = ACK_WAIT_BOUNDS_S
    if not low <= ack_wait_s <= high:
        raise ConsumerFilterError(f"ack_wait_s must lie in {low:g}..{high:g} seconds, got {ack_wait_s!r}")
    if position not in CONSUMER_POSITIONS:
        raise ConsumerFilterError(f"position must be one of {', '.join(CONSUMER_POSITIONS)}, got {position!r}")
    if start_after is not None and (isinstance(start_after, bool) or not 0 <= start_after < 2**63 - 1):
        raise ConsumerFilterError(f"start_after must be a stream sequence (0 or more), got {start_after!r}")
    config = ConsumerConfig(
        durable_name=validate_id("consumer", name),
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        mem_storage=True if position == "reader" else None,
    )
    if start_after:
        config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start_after + 1
    if len(filters) == 1:
        config.filter_subject = filters[0]
    else:
        config.filter_subjects = filters
    return config
