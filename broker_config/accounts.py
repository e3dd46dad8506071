"""What the control plane and the broker agree on about a tenant's NATS identity.

The tenant registry (the API's database) is the source of truth; the broker configuration is rendered from it. The
API only needs this small port: make a fresh user key pair, and apply the full list of tenants. Applying is
level-triggered (the whole registry each time), so a failed or repeated apply is repaired by the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from broker_config.streams import ConsumerPosition


@dataclass(frozen=True)
class TenantAccount:
    """A tenant as the broker sees it: its id and the public nkey of its user (never the seed)."""

    tenant: str
    user_public_key: str


@dataclass(frozen=True)
class UserKeys:
    """A freshly generated NATS user key pair. The seed is shown to the tenant once and never stored."""

    public_key: str
    seed: str = field(repr=False)


@dataclass(frozen=True)
class TenantNatsCredentials:
    """What a tenant needs to connect: servers, its user seed, and where its events are.

    Read events with `nc.jetstream(prefix=js_api_prefix).pull_subscribe_bind(<consumer>, stream=stream)`.
    """

    servers: list[str]
    account: str
    user_public_key: str
    seed: str = field(repr=False)
    stream: str
    js_api_prefix: str
    subject_prefix: str


@dataclass(frozen=True)
class EventConsumer:
    """A tenant's durable pull consumer on its events stream, as the tenant reads it."""

    name: str
    stream: str
    js_api_prefix: str
    filter_subjects: list[str]
    ack_wait_s: float
    position: ConsumerPosition = "broker"
    """Who keeps its ack point across a broker restart (broker_config.streams.ConsumerPosition)."""
    stream_created: str | None = None
    """When the stream was created: names this incarnation of it, which a reader's recorded position belongs to."""


class TenantBroker(Protocol):
    """The broker operations the control plane depends on."""

    def new_user_keys(self) -> UserKeys:
        """Generate a key pair for a new tenant user."""
        ...

    async def apply(self, tenants: Sequence[TenantAccount]) -> None:
        """Make the broker serve exactly these tenants (accounts, permissions, event streams); idempotent."""
        ...

    def credentials(self, tenant: str, keys: UserKeys) -> TenantNatsCredentials:
        """The connection details to hand to a tenant whose user has `keys`."""
        ...

    async def ensure_consumer(
        self,
        tenant: str,
        name: str,
        *,
        filter_subjects: Sequence[str],
        ack_wait_s: float,
        position: ConsumerPosition = "broker",
        start_after: int | None = None,
        stream_created: str | None = None,
    ) -> EventConsumer:
        """Create or update a tenant's durable pull consumer; filters must lie in the tenant's slice. `start_after`
        (a stream sequence) applies only when the consumer is created, and only in the stream created at
        `stream_created` (when given)."""
        ...
