"""In-memory implementations of the `TenantBroker` port, for the API's fast tests.

A real implementation of the protocol, not a mock: it generates real NATS user nkeys (so the API stores and returns
keys of the real format) and keeps the tenant list it was last told to serve, which is what a nats-server would hold.
The nats-server-backed broker has its own end-to-end tests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import nkeys

from broker_config.accounts import EventConsumer, TenantAccount, TenantNatsCredentials, UserKeys
from broker_config.streams import ConsumerPosition

SERVERS = ["nats://in-memory.invalid:4222"]
JS_API_PREFIX = "$JS.hz.API"


class BrokerDownError(ConnectionError):
    """What a broker that cannot be reached raises from `apply`."""


class InMemoryBroker:
    """Serves whatever tenant list it was last given, and remembers every list it was given."""

    def __init__(self) -> None:
        self.applied: list[list[TenantAccount]] = []
        self.issued: list[UserKeys] = []
        self.consumers: dict[tuple[str, str], EventConsumer] = {}
        self.starts: dict[tuple[str, str], int | None] = {}
        """The `start_after` each consumer was last asked for with."""

    @property
    def serving(self) -> list[TenantAccount]:
        """The tenants the broker serves now (the last applied list)."""
        return self.applied[-1] if self.applied else []

    def new_user_keys(self) -> UserKeys:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        public_key = nkeys.from_seed(bytearray(seed)).public_key
        keys = UserKeys(public_key=public_key.decode(), seed=seed.decode())
        self.issued.append(keys)
        return keys

    async def apply(self, tenants: Sequence[TenantAccount]) -> None:
        self.applied.append(list(tenants))

    def credentials(self, tenant: str, keys: UserKeys) -> TenantNatsCredentials:
        return TenantNatsCredentials(
            servers=list(SERVERS),
            account=f"T_{tenant}",
            user_public_key=keys.public_key,
            seed=keys.seed,
            stream=f"HZ_T_{tenant}",
            js_api_prefix=JS_API_PREFIX,
            subject_prefix=f"hz.t.{tenant}.",
        )


    async def ensure_consumer(
        self, tenant: str, name: str, *, filter_subjects: Sequence[str], ack_wait_s: float,
        position: ConsumerPosition = "broker", start_after: int | None = None, stream_created: str | None = None,
    ) -> EventConsumer:
        consumer = EventConsumer(name=name, stream=f"HZ_T_{tenant}", js_api_prefix=JS_API_PREFIX,
                                 filter_subjects=list(filter_subjects), ack_wait_s=ack_wait_s, position=position)
        self.starts[(tenant, name)] = start_after
        self.consumers[(tenant, name)] = consumer
        return consumer


class FailingBroker(InMemoryBroker):
    """A broker that accepts the start-up reconciliation, then fails every apply after `fail_after` successes."""

    def __init__(self, *, fail_after: int = 1) -> None:
        super().__init__()
        self.fail_after = fail_after
        self.attempts = 0

    async def apply(self, tenants: Sequence[TenantAccount]) -> None:
        self.attempts += 1
        if self.attempts > self.fail_after:
            raise BrokerDownError("nats-server did not reload its configuration")
        await super().apply(tenants)
