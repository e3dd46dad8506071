"""The provider's publishing port: tenant events into JetStream, desired state into the KV bucket.

The control plane's outbox relay depends only on `ProviderBus`; `NatsProviderBus` is the real one. It connects in
the provider's account with the seed derived from the provider secret (`ProviderKeys(secret).provider.seed`), so no
extra credential exists to store or rotate.

Delivery is at-least-once by design, and both operations are safe to repeat:

* `publish_event` sends with `Nats-Msg-Id` = the CloudEvent id and waits for the PubAck, retrying until it comes (or
  the attempts run out, when it raises and the relay retries later). A retry of a message that was stored but whose
  ack was lost is dropped by JetStream's duplicate window; beyond the window, consumers dedup by CloudEvent id.
  Core-NATS publishes buffered during a reconnect can be lost (docs/building-blocks.md), which is why nothing here is
  fire-and-forget.
* A tenant event that carries a W3C `traceparent` (and `tracestate`) is published with the same values as NATS
  headers, so a consumer can continue the trace without decoding the body first.
* `put_desired` writes a host's whole assignment under its key: writing the same value twice is harmless, and the
  relay writes in order, so a key never goes back to an older generation.

The KV bucket is created if missing, as the agents would create it (`broker_config.buckets`, `replicas` as the
broker's setting says).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Protocol

import nats
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.buckets import desired_state_bucket, ensure_bucket
from broker_config.keys import ProviderKeys
from harmonaize.events import CONTENT_TYPE

_log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
TRACE_HEADERS = ("traceparent", "tracestate")


class ProviderBusError(ConnectionError):
    """The broker did not take the message (unreachable, no PubAck in time); the caller should retry later."""


class ProviderBus(Protocol):
    """What the control plane publishes through."""

    async def publish_event(self, subject: str, payload: bytes, msg_id: str) -> None:
        """Store one tenant event in JetStream; returns once the PubAck arrived."""
        ...

    async def put_desired(self, key: str, payload: bytes) -> None:
        """Write a host's desired state into the desired-state KV bucket."""
        ...

    async def close(self) -> None:
        """Drop the connection (the bus may be used again: it reconnects)."""
        ...


async def _ignore_errors(_: Exception) -> None:
    return None


def trace_headers(payload: bytes) -> dict[str, str]:
    """The W3C trace context a structured-mode CloudEvent carries, as NATS headers (empty if none or not JSON)."""
    try:
        event = json.loads(payload)
    except ValueError:
        return {}
    if not isinstance(event, dict):
        return {}
    return {name: value for name in TRACE_HEADERS if isinstance(value := event.get(name), str) and value}


class NatsProviderBus:
    """`ProviderBus` over a nats-server, connected lazily as the provider, reconnecting as needed."""

    def __init__(
        self,
        servers: Sequence[str],
        *,
        provider_secret: bytes,
        connect_timeout: float = 2.0,
        ack_timeout: float = 2.0,
        publish_attempts: int = 3,
        replicas: int = 1,
    ) -> None:
        self.servers = list(servers)
        self._seed = ProviderKeys(provider_secret).provider.seed
        self._connect_timeout = connect_timeout
        self._ack_timeout = ack_timeout
        self._attempts = max(1, publish_attempts)
        self._bucket = desired_state_bucket(replicas=replicas)
        self._client: Client | None = None
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()

    async def _connected(self) -> Client:
        async with self._lock:
            if self._client is not None and not self._client.is_closed:
                return self._client
            self._kv = None
            try:
                self._client = await asyncio.wait_for(
                    nats.connect(
                        servers=self.servers,
                        nkeys_seed_str=self._seed,
                        connect_timeout=self._connect_timeout,
                        allow_reconnect=True,
                        max_reconnect_attempts=-1,
                        reconnect_time_wait=0.2,
                        error_cb=_ignore_errors,
                    ),
                    self._connect_timeout * 2,
                )
            except Exception as exc:  # nats-py raises several types for an unreachable or refusing server
                raise ProviderBusError(f"cannot connect to the broker at {', '.join(self.servers)}: {exc!r}") from exc
            return self._client

    async def _bucket_handle(self) -> KeyValue:
        client = await self._connected()
        if self._kv is None:
            self._kv = await ensure_bucket(client.jetstream(timeout=self._ack_timeout), self._bucket)
        return self._kv

    async def publish_event(self, subject: str, payload: bytes, msg_id: str) -> None:
        last: Exception | None = None
        trace = trace_headers(payload)
        for attempt in range(self._attempts):
            if attempt:
                await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
            try:
                client = await self._connected()
                await client.jetstream().publish(
                    subject, payload, timeout=self._ack_timeout,
                    headers={MSG_ID_HEADER: msg_id, "Content-Type": CONTENT_TYPE, **trace},
                )
                return
            except Exception as exc:  # timeouts, no responders, reconnecting: all mean "no PubAck yet"
                last = exc
                _log.debug("publish of %s to %s not acknowledged (attempt %d): %r", msg_id, subject, attempt + 1, exc)
        raise ProviderBusError(f"no PubAck for {subject} ({msg_id}) after {self._attempts} attempts: {last!r}")

    async def put_desired(self, key: str, payload: bytes) -> None:
        try:
            kv = await self._bucket_handle()
            await kv.put(key, payload)
        except ProviderBusError:
            raise
        except Exception as exc:
            self._kv = None
            raise ProviderBusError(f"cannot write {key} to the {self._bucket} bucket: {exc!r}") from exc

    async def close(self) -> None:
        async with self._lock:
            client, self._client, self._kv = self._client, None, None
        if client is not None and not client.is_closed:
            try:
                await client.close()
            except (ConnectionError, OSError) as exc:  # the connection was already lost: nothing left to flush
                _log.debug("closing a lost broker connection: %r", exc)
