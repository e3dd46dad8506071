"""The desired-state bucket, seen from the provider's agents: create it if missing, and mirror it locally.

The control plane writes one `HostAssignment` per host into the KV bucket `DESIRED_STATE_BUCKET` (key `host.<id>`).
Agents are level-triggered on it, like Kubernetes controllers on an informer cache: `FleetView` keeps an in-memory
mirror of every host's current value, and the agent's loop reads the mirror each tick and converges to it. Nothing
is inferred from the order or number of updates, so a restarted agent, a missed update or a reconnect all end in the
same place: the current value.

Why every host's key and not only our own: a job's topology, its network paths, and which of its hosts reports a
job-wide fact all depend on where else the job runs. The mirror is provider-internal and never leaves the agent.

The watcher is restarted every `resync_s` (and after any error), each time replaying the last value of every key,
so a watch that silently died (a consumer lost in a broker restart) costs at most one resync period. The new
snapshot replaces the old one only once it is complete, so readers never see a half-loaded fleet.

Bucket configuration (file storage, history 5, nothing else) is exactly the control plane's
(`broker_config.provider_bus`): whichever side starts first creates the bucket, the other binds to it, and two
creators racing each other send identical configurations, which JetStream accepts as one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import nats.errors
from nats.js.client import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from broker_config.buckets import desired_state_bucket, ensure_bucket
from harmonaize.desired_state import HostAssignment, host_key

__all__ = [
    "DesiredState",
    "FleetView",
    "ensure_desired_state_bucket",
]

log = logging.getLogger(__name__)

_HOST_KEYS = "host.*"
_HOST_PREFIX = host_key("x")[:-1]


class _Watcher(Protocol):
    """What we use of nats-py's `KeyValue.KeyWatcher`, typed (nats-py leaves these methods unannotated)."""

    async def updates(self, timeout: float = ...) -> KeyValue.Entry | None:
        """The next update; None marks the end of the initial replay. Raises `nats.errors.TimeoutError`."""
        ...

    async def stop(self) -> None: ...


class DesiredState(Protocol):
    def snapshot(self) -> Mapping[str, HostAssignment] | None:
        """Every host's assignment by host id, or None while the desired state has not been loaded yet."""
        ...


async def ensure_desired_state_bucket(js: JetStreamContext, *, replicas: int = 1) -> KeyValue:
    """Bind to the bucket, creating it when missing (`broker_config.buckets`: racing creators share one bucket, and
    one with fewer than `replicas` replicas is scaled up)."""
    return await ensure_bucket(js, desired_state_bucket(replicas=replicas))


class FleetView:
    """A local mirror of every host's desired state, kept current by a KV watch.

    `kv` is the bucket, or a coroutine function that binds it: then binding is retried inside the watch loop, so a
    process can start (and heartbeat) while JetStream is still unavailable, its view simply not loaded yet.
    """

    def __init__(
        self, kv: KeyValue | Callable[[], Awaitable[KeyValue]], *, resync_s: float = 30.0, retry_s: float = 1.0
    ) -> None:
        self._kv: KeyValue | None = kv if isinstance(kv, KeyValue) else None
        self._bind = None if isinstance(kv, KeyValue) else kv
        self._resync_s = resync_s
        self._retry_s = retry_s
        self._fleet: dict[str, HostAssignment] | None = None
        self._task: asyncio.Task[None] | None = None
        self.version = 0
        self.loads = 0

    def snapshot(self) -> Mapping[str, HostAssignment] | None:
        return None if self._fleet is None else MappingProxyType(dict(self._fleet))

    def assignment(self, host: str) -> HostAssignment | None:
        return None if self._fleet is None else self._fleet.get(host)

    @property
    def loaded(self) -> bool:
        return self._fleet is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hz-fleet-view")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self._watch_for_a_while()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("desired-state watch failed, retrying in %.1f s: %r", self._retry_s, exc)
                await asyncio.sleep(self._retry_s)

    async def _watch_for_a_while(self) -> None:
        if self._kv is None:
            assert self._bind is not None
            self._kv = await self._bind()
        watcher: _Watcher = await self._kv.watch(_HOST_KEYS)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._resync_s
        fresh: dict[str, HostAssignment] = {}
        complete = False
        try:
            while (remaining := deadline - loop.time()) > 0:
                try:
                    entry = await watcher.updates(timeout=remaining)
                except nats.errors.TimeoutError:
                    break
                if entry is None:
                    complete = True
                    self._replace(fresh)
                    continue
                target = self._fleet if complete and self._fleet is not None else fresh
                if _apply(target, entry.key, entry.value, entry.operation):
                    if target is self._fleet:
                        self._bump()
        finally:
            await watcher.stop()

    def _replace(self, fresh: dict[str, HostAssignment]) -> None:
        self.loads += 1
        if self._fleet != fresh:
            self._fleet = dict(fresh)
            self._bump()

    def _bump(self) -> None:
        self.version += 1


def _apply(fleet: dict[str, HostAssignment], key: str, value: bytes | None, operation: str | None) -> bool:
    """Apply one KV entry to a mirror; True when the mirror changed."""
    if not key.startswith(_HOST_PREFIX):
        return False
    host = key[len(_HOST_PREFIX) :]
    if operation in (KV_DEL, KV_PURGE):
        return fleet.pop(host, None) is not None
    try:
        assignment = HostAssignment.model_validate_json(value or b"")
    except ValidationError as exc:
        log.error("ignoring malformed desired state under %s: %s", key, exc.errors()[:1])
        return False
    if assignment.host != host:
        log.error("ignoring desired state under %s: it is for host %r", key, assignment.host)
        return False
    if fleet.get(host) == assignment:
        return False
    fleet[host] = assignment
    return True
