"""In-memory stand-ins for the agent's ports, written as real classes implementing the same protocols.

They let the fast tests run the agent loop, the publisher and the fleet monitor without a broker: a scripted
telemetry source, a settable desired state, sinks that record what was published, and a JetStream that fails on cue.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import nats.errors
from nats.js.api import PubAck

from harmonaize.desired_state import AssignedJob, HostAssignment
from harmonaize.events import CloudEvent
from provider_agents.telemetry.model import FabricSample, GpuSample, HostTelemetry

START = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


class ScriptedSource:
    """Returns the scripted snapshots in order (an Exception in the script is raised instead)."""

    def __init__(self, host: str, script: Iterable[HostTelemetry | Exception], *, locality_group: str = "g1") -> None:
        self.host = host
        self.locality_group = locality_group
        self._script = list(script)
        self.samples = 0

    def sample(self) -> HostTelemetry:
        item = self._script[min(self.samples, len(self._script) - 1)]
        self.samples += 1
        if isinstance(item, Exception):
            raise item
        return item


class StaticDesiredState:
    """A desired state the test sets directly (None = not loaded yet)."""

    def __init__(self, fleet: Mapping[str, HostAssignment] | None = None) -> None:
        self.fleet = None if fleet is None else dict(fleet)

    def snapshot(self) -> Mapping[str, HostAssignment] | None:
        return None if self.fleet is None else dict(self.fleet)

    def put(self, assignment: HostAssignment) -> None:
        self.fleet = {**(self.fleet or {}), assignment.host: assignment}


@dataclass
class Published:
    subject: str
    event: CloudEvent[Any]

    @property
    def kind(self) -> str:
        return self.subject.split(".")[4]

    @property
    def tenant(self) -> str:
        return self.subject.split(".")[2]


@dataclass
class RecordingSink:
    """An EventSink that keeps everything submitted."""

    items: list[Published] = field(default_factory=list)

    async def submit(self, subject: str, event: CloudEvent[Any]) -> None:
        self.items.append(Published(subject, event))

    def kinds(self, tenant: str | None = None) -> list[str]:
        return [p.kind for p in self.items if tenant is None or p.tenant == tenant]


@dataclass
class RecordingRawSink:
    """A RawSink that keeps (subject, decoded JSON) pairs."""

    items: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def publish_raw(self, subject: str, payload: bytes) -> bool:
        self.items.append((subject, json.loads(payload)))
        return True

    def on(self, suffix: str) -> list[dict[str, Any]]:
        return [body for subject, body in self.items if subject.endswith(suffix)]


class FlakyJetStream:
    """A JetStream publish endpoint that fails the first `failures` attempts, or blocks until released."""

    def __init__(self, *, failures: int = 0, error: Exception | None = None, blocked: bool = False) -> None:
        self.failures = failures
        self.error = error or nats.errors.TimeoutError()
        self.attempts: list[tuple[str, bytes, dict[str, Any] | None]] = []
        self.stored: dict[str, bytes] = {}
        self.release = asyncio.Event()
        if not blocked:
            self.release.set()

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> PubAck:
        self.attempts.append((subject, payload, headers))
        await self.release.wait()
        if len(self.attempts) <= self.failures:
            raise self.error
        msg_id = (headers or {}).get("Nats-Msg-Id", "")
        duplicate = msg_id in self.stored
        self.stored.setdefault(msg_id, payload)
        return PubAck(stream="HZ_T_fake", seq=len(self.stored), duplicate=duplicate)


def assignment(host: str, group: str, *jobs: tuple[str, str], gpus: int = 4, generation: int = 1) -> HostAssignment:
    """A host's desired state with (tenant, job) pairs, each with `gpus` GPUs."""
    return HostAssignment(
        host=host,
        locality_group=group,
        generation=generation,
        jobs=tuple(AssignedJob(tenant=t, job=j, workers=1, gpus=gpus) for t, j in jobs),
        updated_at=START,
    )


def telemetry(host: str, group: str = "g1", *, at: datetime = START, **parts: Any) -> HostTelemetry:
    """A healthy two-GPU snapshot, with any parts replaced."""
    values: dict[str, Any] = {
        "host": host,
        "locality_group": group,
        "sampled_at": at,
        "gpus": tuple(
            GpuSample(index=i, serial=f"SERIAL-{host}-{i}", power_w=500.0, utilization=0.9, memory_gib=80.0)
            for i in range(2)
        ),
        "fabric": FabricSample(intra_group_gbps=400.0, inter_group_gbps=100.0),
    }
    values.update(parts)
    return HostTelemetry(**values)
