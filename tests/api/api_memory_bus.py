"""An in-memory `ProviderBus`: a real implementation of the port for the relay's fast tests, not a mock.

It behaves like the broker where it matters: the event stream drops a message whose id it already stored (JetStream's
duplicate window on `Nats-Msg-Id`), the KV keeps every revision of a key, and the bus can be taken down, or made to
store a message but lose its acknowledgement (what a crash between publishing and marking looks like to the relay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_config.provider_bus import ProviderBusError


@dataclass
class MemoryProviderBus:
    events: list[tuple[str, bytes, str]] = field(default_factory=list)
    kv: dict[str, list[bytes]] = field(default_factory=dict)
    down: bool = False
    lose_acks: int = 0
    """Store the next n events but raise as if their PubAck never came."""
    attempts: int = 0
    duplicates_dropped: int = 0

    async def publish_event(self, subject: str, payload: bytes, msg_id: str) -> None:
        self.attempts += 1
        if self.down:
            raise ProviderBusError("the broker is down")
        if msg_id in {stored_id for _, _, stored_id in self.events}:
            self.duplicates_dropped += 1
        else:
            self.events.append((subject, payload, msg_id))
        if self.lose_acks:
            self.lose_acks -= 1
            raise ProviderBusError(f"no PubAck for {msg_id}")

    async def put_desired(self, key: str, payload: bytes) -> None:
        self.attempts += 1
        if self.down:
            raise ProviderBusError("the broker is down")
        self.kv.setdefault(key, []).append(payload)

    async def close(self) -> None:
        return None
