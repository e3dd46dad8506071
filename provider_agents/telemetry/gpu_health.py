"""GPU health from NVIDIA NVSentinel: its `HealthEvent`s, polled over HTTP, as this host's `FailureSignal`s.

NVSentinel's monitors (DCGM, syslog XIDs, NVSwitch) know more about a GPU's health than NVML's counters do, and they
say when a condition has cleared. This module reads their events; it does not talk to NVSentinel's gRPC socket.

**Input path.** `NvSentinelPoller` sends `GET <url>` every `interval_s` and expects a JSON list of events, or the
batch shape of NVSentinel's `HealthEvents` message, `{"version": 1, "events": [...]}`. Each item is either

* a bare HealthEvent (the `datamodels.HealthEvent` protobuf in JSON: camelCase fields, `recommendedAction` as the
  enum name or number, `generatedTimestamp` as RFC 3339), or
* a CloudEvent as NVSentinel's event-exporter writes it (`type: com.nvidia.nvsentinel.health.v1`, the event under
  `data.healthEvent`, `recommendedAction` as its number).

The exporter pushes to a sink; whatever collects its events (a node-local relay, a fleet collector) serves the recent
ones at the URL. The list may be a rolling window repeated from poll to poll: applying an event twice changes
nothing, and an event older than what was already applied to the same check, entity and code is ignored, so a
replayed window never brings back a cleared signal.

**Mapping.** Only events whose `nodeName` is this host count. An unhealthy fatal event is a `GPU_ERROR`, an unhealthy
non-fatal one `DEGRADED`, one signal per impacted GPU index (`entitiesImpacted` of type `GPU`) and error code; events
naming no GPU index (NVSwitch, node-level checks) are host-level (`gpu_index=None`). `component` keeps the component
class, check name and non-GPU entity, `reason` the error code (`xid_<n>` for an XID check, which the projection may
show to tenants) or else the message: provider-internal text. An `isHealthy: true` event clears what it names: its
codes (all codes without any), on its GPUs or entity (every entity of the check without any). A signal's
`detected_at` is the `generatedTimestamp` of the first unhealthy event that raised it.

Bad input (malformed JSON, a missing or mistyped field, an unknown `recommendedAction`, a GPU index out of range, an
event both fatal and healthy) is logged and skipped, never turned into a signal; events for other nodes are skipped
quietly (a fleet collector serves them all). When the endpoint fails (an HTTP error, a timeout, a body that is not
JSON) the poller logs (once per streak and kind), backs off exponentially up to `max_backoff_s` (the agent's shared
polling core, `provider_agents.telemetry.polling`), and keeps the signals it has: a fatal GPU error does not heal
because its reporter is unreachable. As a `SignalChannel` it joins a `NoticeOverlay`, which adds its signals to the
host's `failures`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from typing import Any, Final

import httpx

from harmonaize.times import parse_rfc3339
from provider_agents.telemetry.model import FailureSignal, RawFailureKind
from provider_agents.telemetry.notices.channel import NoticeView
from provider_agents.telemetry.polling import Background, PollHealth, PollState, failure_key, http_client, retry_after_s

__all__ = [
    "EXPORTER_EVENT_TYPE",
    "ActiveHealthSignals",
    "HealthEvent",
    "HealthEventError",
    "NvSentinelPoller",
    "RecommendedAction",
    "batch_items",
    "parse_health_event",
]

log = logging.getLogger(__name__)

EXPORTER_EVENT_TYPE: Final = "com.nvidia.nvsentinel.health.v1"
"""The CloudEvent `type` of NVSentinel's event-exporter."""

_MAX_GPU_INDEX = 63
_MAX_TEXT = 200
_INDEX_RE = re.compile(r"[0-9]{1,3}", re.ASCII)
_XID_CODE_RE = re.compile(r"(xid[-_ ]?)?([0-9]{1,3})", re.ASCII | re.IGNORECASE)
_WORD_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+", re.ASCII)
"""Words of a camelCase or snake_case check name: SysLogsXIDError -> Sys, Logs, XID, Error."""


class HealthEventError(ValueError):
    """A document that is not a usable NVSentinel HealthEvent (or batch of them)."""


class RecommendedAction(IntEnum):
    """NVSentinel's `RecommendedAction` enum (data-models/protobufs/health_event.proto); names and numbers."""

    NONE = 0
    COMPONENT_RESET = 2
    CONTACT_SUPPORT = 5
    RUN_FIELDDIAG = 6
    RESTART_VM = 15
    RESTART_BM = 24
    REPLACE_VM = 25
    RUN_DCGMEUD = 26
    RESTART_APP = 39
    UNKNOWN = 99


Entity = tuple[str, str]
"""An impacted entity that is not a GPU index: (entityType, entityValue)."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """One validated HealthEvent, with the fields this module uses."""

    node_name: str
    component_class: str
    check_name: str
    is_fatal: bool
    is_healthy: bool
    generated_at: datetime
    recommended_action: RecommendedAction = RecommendedAction.NONE
    error_codes: tuple[str, ...] = ()
    gpu_indices: tuple[int, ...] = ()
    """Impacted GPUs by index (entities of type `GPU` with a decimal value)."""
    entity: Entity | None = None
    """The first other impacted entity, when no GPU index is named (`PCI` and `GPU_UUID` only qualify a GPU)."""
    message: str = ""
    agent: str = ""


def parse_health_event(document: object) -> HealthEvent:
    """Validate one HealthEvent (bare, or inside an event-exporter CloudEvent); raise `HealthEventError` if bad."""
    event = _unwrap(document)
    node_name = _text(event, "nodeName")
    component_class = _text(event, "componentClass")
    check_name = _text(event, "checkName")
    is_fatal = _flag(event, "isFatal")
    is_healthy = _flag(event, "isHealthy")
    if is_fatal and is_healthy:
        raise HealthEventError("an event cannot be both fatal and healthy")
    stamp = event.get("generatedTimestamp")
    if not isinstance(stamp, str):
        raise HealthEventError("generatedTimestamp: expected an RFC 3339 string")
    try:
        generated_at = parse_rfc3339(stamp)
    except ValueError as exc:
        raise HealthEventError(f"generatedTimestamp: {exc}") from None
    codes = _strings(event.get("errorCode", []), "errorCode")
    gpu_indices, entity = _entities(event.get("entitiesImpacted", []))
    message = event.get("message", "")
    agent = event.get("agent", "")
    if not isinstance(message, str) or not isinstance(agent, str):
        raise HealthEventError("message and agent must be strings")
    return HealthEvent(
        node_name=node_name,
        component_class=component_class,
        check_name=check_name,
        is_fatal=is_fatal,
        is_healthy=is_healthy,
        generated_at=generated_at,
        recommended_action=_action(event.get("recommendedAction", RecommendedAction.NONE.name)),
        error_codes=tuple(dict.fromkeys(code.strip() for code in codes if code.strip())),
        gpu_indices=gpu_indices,
        entity=entity,
        message=message.strip(),
        agent=agent,
    )


def batch_items(payload: object) -> list[object]:
    """The events of one response body: a JSON list, or `{"events": [...]}` (NVSentinel's `HealthEvents`)."""
    if isinstance(payload, list):
        return payload
    if isinstance(payload, dict) and isinstance(payload.get("events"), list):
        return list(payload["events"])
    raise HealthEventError('expected a JSON list of events or {"events": [...]}')


def _unwrap(document: object) -> Mapping[str, Any]:
    if not isinstance(document, dict):
        raise HealthEventError(f"expected a JSON object, got {type(document).__name__}")
    if "specversion" not in document:
        return document
    if document.get("type") != EXPORTER_EVENT_TYPE:
        raise HealthEventError(f"CloudEvent type {document.get('type')!r} is not {EXPORTER_EVENT_TYPE}")
    data = document.get("data")
    inner = data.get("healthEvent") if isinstance(data, dict) else None
    if not isinstance(inner, dict):
        raise HealthEventError("CloudEvent without data.healthEvent")
    return inner


def _text(event: Mapping[str, Any], name: str) -> str:
    value = event.get(name)
    if not isinstance(value, str) or not value.strip():
        raise HealthEventError(f"{name}: a non-empty string is required")
    if len(value) > _MAX_TEXT:
        raise HealthEventError(f"{name}: longer than {_MAX_TEXT} characters")
    return value.strip()


def _flag(event: Mapping[str, Any], name: str) -> bool:
    value = event.get(name)
    if not isinstance(value, bool):
        raise HealthEventError(f"{name}: true or false is required")
    return value


def _strings(value: object, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise HealthEventError(f"{name}: expected a list of strings")
    return list(value)


def _action(value: object) -> RecommendedAction:
    try:
        if isinstance(value, str):
            return RecommendedAction[value]
        if isinstance(value, int) and not isinstance(value, bool):
            return RecommendedAction(value)
    except (KeyError, ValueError):
        pass
    raise HealthEventError(f"recommendedAction: unknown value {value!r}")


def _entities(value: object) -> tuple[tuple[int, ...], Entity | None]:
    if not isinstance(value, list):
        raise HealthEventError("entitiesImpacted: expected a list")
    indices: list[int] = []
    others: list[Entity] = []
    for item in value:
        if not isinstance(item, dict):
            raise HealthEventError("entitiesImpacted: each entity is an object")
        kind, text = item.get("entityType"), item.get("entityValue")
        if not isinstance(kind, str) or not kind or not isinstance(text, str):
            raise HealthEventError("entitiesImpacted: entityType and entityValue must be strings")
        if kind.upper() == "GPU" and _INDEX_RE.fullmatch(text):
            index = int(text)
            if index > _MAX_GPU_INDEX:
                raise HealthEventError(f"entitiesImpacted: GPU index {index} out of range 0..{_MAX_GPU_INDEX}")
            indices.append(index)
        elif kind.upper() not in {"PCI", "GPU_UUID"}:
            others.append((kind, text))
    if indices:
        return tuple(sorted(set(indices))), None
    if others:
        return (), others[0]
    # a GPU named only by its UUID or PCI address: host-level, but keep what names it
    qualifier = next(((item["entityType"], item["entityValue"]) for item in value), None)
    return (), qualifier


_ANY: Final = "*"
"""Wildcard in a clear mark: every entity of a check, or every code."""

Target = int | Entity | None
"""What a signal is about: a GPU index, another entity, or the host (None)."""


@dataclass(slots=True)
class _Active:
    detected_at: datetime
    updated_at: datetime
    signal: FailureSignal


@dataclass
class ActiveHealthSignals:
    """The signals NVSentinel's events currently raise on one node (`node_name`), fed one document at a time."""

    node_name: str
    _active: dict[tuple[str, str, Target, str], _Active] = field(default_factory=dict, init=False, repr=False)
    _cleared: dict[tuple[str, str, Target | str, str], datetime] = field(default_factory=dict, init=False, repr=False)
    """When each (class, check, target or *, code or *) was last cleared: older unhealthy events are replays."""

    def ingest(self, document: object) -> bool:
        """Parse and apply one document; bad ones and other nodes' are logged and skipped. True if state changed."""
        try:
            event = parse_health_event(document)
        except HealthEventError as exc:
            log.warning("skipping a bad NVSentinel health event: %s", exc)
            return False
        if event.node_name != self.node_name:
            log.debug("skipping a health event for node %r (this is %r)", event.node_name, self.node_name)
            return False
        return self.apply(event)

    def apply(self, event: HealthEvent) -> bool:
        """Apply a validated event of this node. True if the set of signals changed."""
        if event.node_name != self.node_name:
            return False
        if event.is_healthy:
            return self._clear(event)
        return self._raise(event)

    def signals(self) -> tuple[FailureSignal, ...]:
        """The active signals, in a stable order (GPU index, then component and reason)."""
        ordered = sorted(
            (active.signal for active in self._active.values()),
            key=lambda s: (-1 if s.gpu_index is None else s.gpu_index, s.component or "", s.reason or ""),
        )
        return tuple(ordered)

    def _raise(self, event: HealthEvent) -> bool:
        changed = False
        for target in _targets(event):
            for code in event.error_codes or ("",):
                changed |= self._raise_one(event, target, code)
        return changed

    def _raise_one(self, event: HealthEvent, target: Target, code: str) -> bool:
        check = (event.component_class.upper(), event.check_name)
        marks = [self._cleared.get((*check, t, c)) for t in (target, _ANY) for c in (code, _ANY)]
        if any(mark is not None and event.generated_at <= mark for mark in marks):
            return False  # cleared by a later (or same-instant) healthy event: a replay
        key = (*check, target, code)
        active = self._active.get(key)
        if active is not None and event.generated_at < active.updated_at:
            return False
        detected_at = active.detected_at if active is not None else event.generated_at
        signal = FailureSignal(
            kind=RawFailureKind.GPU_ERROR if event.is_fatal else RawFailureKind.DEGRADED,
            gpu_index=target if isinstance(target, int) else None,
            component=_component(event, target),
            detected_at=detected_at,
            reason=_reason(event, code),
        )
        self._active[key] = _Active(detected_at, event.generated_at, signal)
        return active is None or active.signal != signal

    def _clear(self, event: HealthEvent) -> bool:
        check = (event.component_class.upper(), event.check_name)
        targets: Iterable[Target | str] = _targets(event) if (event.gpu_indices or event.entity) else (_ANY,)
        codes: Iterable[str] = event.error_codes or (_ANY,)
        changed = False
        for target in targets:
            for code in codes:
                mark_key = (*check, target, code)
                previous = self._cleared.get(mark_key)
                if previous is None or event.generated_at > previous:
                    self._cleared[mark_key] = event.generated_at
                for key, active in list(self._active.items()):
                    if key[:2] != check or active.updated_at > event.generated_at:
                        continue
                    if target not in (_ANY, key[2]) or code not in (_ANY, key[3]):
                        continue
                    del self._active[key]
                    changed = True
        return changed


def _targets(event: HealthEvent) -> tuple[Target, ...]:
    if event.gpu_indices:
        return event.gpu_indices
    return (event.entity,)


def _component(event: HealthEvent, target: Target) -> str:
    text = f"{event.component_class}/{event.check_name}"
    if isinstance(target, tuple):
        text += f" {target[0]}={target[1]}"
    return text[:_MAX_TEXT]


def _reason(event: HealthEvent, code: str) -> str | None:
    if code:
        match = _XID_CODE_RE.fullmatch(code)
        xid_check = "XID" in {word.upper() for word in _WORD_RE.findall(event.check_name)}  # not SXID (NVSwitch)
        if match and (match[1] or xid_check):
            return f"xid_{int(match[2])}"
        return code[:_MAX_TEXT]
    return event.message[:_MAX_TEXT] or None


class NvSentinelPoller:
    """Polls an HTTP endpoint serving NVSentinel health events and keeps this node's active signals.

    It is a `SignalChannel`: `start()`/`stop()` run it in a task of its own, and `view(now)` hands its signals to a
    `NoticeOverlay`, which merges them into the host's `failures`.
    """

    def __init__(
        self,
        url: str,
        *,
        node_name: str,
        interval_s: float = 10.0,
        timeout_s: float = 5.0,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 120.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or not 0 < min_backoff_s <= max_backoff_s:
            raise ValueError("interval, timeout and backoffs must be positive, min_backoff_s <= max_backoff_s")
        self.url = url
        self.name = f"nvsentinel:{node_name}"
        self.interval_s = interval_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.ledger = ActiveHealthSignals(node_name)
        self._poll = PollState(
            f"NVSentinel events from {url}", first_backoff_s=min_backoff_s, max_backoff_s=max_backoff_s, logger=log
        )
        self._client = http_client(timeout_s=timeout_s, headers=headers)
        self._background = Background(self.name, logger=log)

    @property
    def polls(self) -> int:
        """Polls completed, successful or not."""
        return self._poll.polls

    @property
    def failures(self) -> int:
        """Consecutive failed polls (0 after a success)."""
        return self._poll.consecutive_failures

    @property
    def health(self) -> PollHealth:
        return self._poll.health

    def signals(self) -> tuple[FailureSignal, ...]:
        """The node's active signals, as of the last successful poll (kept while polls fail)."""
        return self.ledger.signals()

    def view(self, now: datetime) -> NoticeView:
        """The active signals as an overlay's view (they carry their own times, so `now` changes nothing)."""
        return NoticeView(failures=self.signals())

    @property
    def next_delay_s(self) -> float:
        """How long `run` waits before the next poll: the interval, or the backoff after failures."""
        return self._poll.next_delay_s(self.interval_s)

    async def poll_once(self) -> bool:
        """Fetch and apply the endpoint's events once. False (logged) when the endpoint or its body failed."""
        try:
            response = await self._client.get(self.url)
            response.raise_for_status()
            items = batch_items(json.loads(response.content))
        except (httpx.HTTPError, ValueError) as exc:  # HealthEventError and JSONDecodeError are ValueErrors
            wait = retry_after_s(exc.response.headers) if isinstance(exc, httpx.HTTPStatusError) else None
            self._poll.failed(failure_key(exc), _describe(exc), retry_after_s=wait)
            return False
        for item in items:
            self.ledger.ingest(item)
        self._poll.succeeded()
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.next_delay_s)

    def start(self) -> None:
        """Poll in a task of its own (nothing new while one runs)."""
        self._background.start(self.run)

    async def stop(self) -> None:
        """Stop polling and release the HTTP client."""
        await self._background.stop()
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()


def _describe(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"
