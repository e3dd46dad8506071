"""One received message, checked end to end against CloudEvents and the published interface.

Pure functions over a `Received` (subject, headers, body) and the `Interface`; only `DuplicateTracker` keeps state,
the ids seen so far. The groups:

* binding: the NATS protocol binding (`binding.decode`), and the mode, content type and headers the interface
  promises (its headers schema, `Nats-Msg-Id` equal to the event id, trace headers equal to the attributes);
* envelope: CloudEvents 1.0 (`envelope.check_envelope`), then the published envelope schema of the event's type,
  whose `data` part is left to the schema group so a bad payload is reported once;
* subject: the subject is an address of a channel for this tenant, the channel carries the event's type, and each
  parameter with a payload `location` (`{job}` -> `subject`) agrees with the event;
* schema: `data` validates against the published JSON Schema of the event's `type` (an unknown type fails);
* duplicates: an id seen before. The interface delivers at least once, and CloudEvents lets a producer re-send an
  event under the same id, so an identical re-send is a warning (a failure with `strict`); the same id on a
  different event is a failure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from harmonaize_cli.conformance.binding import ContentMode, Decoded, Received, decode, media_type
from harmonaize_cli.conformance.envelope import check_envelope
from harmonaize_cli.conformance.findings import Finding, Group, failure, warning
from harmonaize_cli.conformance.interface import Interface

__all__ = [
    "DuplicateTracker",
    "MessageResult",
    "check_binding",
    "check_message",
    "check_published_envelope",
    "check_schema",
    "check_subject",
]

MAX_ERRORS_PER_CHECK: Final = 8
"""Schema errors reported per event and check: the first few say what is wrong; hundreds would bury other events."""
_MSG_ID_HEADER: Final = "Nats-Msg-Id"
_TRACE_ATTRIBUTES: Final = ("traceparent", "tracestate")


@dataclass(frozen=True, slots=True)
class MessageResult:
    """What checking one message found, and which groups could check it (an unreadable body stops at binding)."""

    subject: str
    event_id: str | None
    event_type: str | None
    checked: frozenset[Group]
    findings: tuple[Finding, ...]

    @property
    def failed(self) -> bool:
        return any(finding.severity == "failure" for finding in self.findings)


class DuplicateTracker:
    """The ids seen so far, each with a digest of its event, to tell a re-send from a different event."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self._seen: dict[str, tuple[str, str]] = {}
        self.duplicates = 0

    def see(self, event_id: str, event: Mapping[str, Any], *, subject: str) -> Finding | None:
        """None the first time `event_id` is seen; after that, the finding the duplicate deserves."""
        digest = hashlib.sha256(json.dumps(event, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        first = self._seen.get(event_id)
        if first is None:
            self._seen[event_id] = (digest, subject)
            return None
        self.duplicates += 1
        if first != (digest, subject):
            return failure(Group.DUPLICATES, f"duplicate id {event_id!r}: a different event than the one first seen "
                                             f"with it (on {first[1]})")
        reason = f"duplicate id {event_id!r}: the same event again (a re-send; consumers de-duplicate by id)"
        return failure(Group.DUPLICATES, reason) if self.strict else warning(Group.DUPLICATES, reason)


def check_message(
    received: Received, *, tenant: str, interface: Interface, duplicates: DuplicateTracker
) -> MessageResult:
    """Every check on one message; groups after binding run only when the message carries a readable event."""
    decoded = decode(received)
    findings = list(decoded.findings)
    event = decoded.event
    if event is None:
        return MessageResult(received.subject, None, None, frozenset({Group.BINDING}), tuple(findings))
    event_id = event.get("id") if isinstance(event.get("id"), str) and event.get("id") else None
    event_type = event.get("type") if isinstance(event.get("type"), str) else None
    checked = {Group.BINDING, Group.ENVELOPE, Group.SUBJECT, Group.SCHEMA}
    findings += check_binding(received, decoded, interface=interface)
    findings += check_envelope(event)
    findings += check_published_envelope(event, interface=interface)
    findings += check_subject(received.subject, event, tenant=tenant, interface=interface)
    findings += check_schema(event, interface=interface)
    if event_id is not None:
        checked.add(Group.DUPLICATES)
        duplicate = duplicates.see(event_id, event, subject=received.subject)
        if duplicate is not None:
            findings.append(duplicate)
    return MessageResult(received.subject, event_id, event_type, frozenset(checked), tuple(findings))


def check_binding(received: Received, decoded: Decoded, *, interface: Interface) -> list[Finding]:
    """The content mode and headers the interface promises for the event's type."""
    event = decoded.event or {}
    event_type: str = event["type"] if isinstance(event.get("type"), str) else ""
    findings: list[Finding] = []
    expected = interface.content_type(event_type)
    if decoded.mode is ContentMode.BINARY and expected is not None and media_type(expected).startswith(
        "application/cloudevents"
    ):
        findings.append(failure(Group.BINDING, f"binary content mode (ce- headers): the interface publishes "
                                               f"structured mode, Content-Type {expected}"))
    validator = interface.headers_validator(event_type)
    if validator is not None:
        findings += [failure(Group.BINDING, f"published headers schema: {reason}")
                     for reason in _errors(validator.iter_errors(dict(received.headers)), whole="headers")]
    msg_id = received.header(_MSG_ID_HEADER)
    if msg_id is not None and isinstance(event.get("id"), str) and msg_id != event["id"]:
        findings.append(failure(Group.BINDING, f"{_MSG_ID_HEADER} header {msg_id!r} is not the event id "
                                               f"{event['id']!r} (JetStream de-duplicates on it)"))
    for name in _TRACE_ATTRIBUTES:
        header = received.header(name)
        if decoded.mode is ContentMode.STRUCTURED and header is not None and name in event and header != event[name]:
            findings.append(failure(Group.BINDING, f"{name} header {header!r} differs from the {name} attribute "
                                                   f"{event[name]!r}"))
    return findings


def check_published_envelope(event: Mapping[str, Any], *, interface: Interface) -> list[Finding]:
    """The published envelope schema of the event's type (its `data` left to `check_schema`)."""
    event_type = event.get("type")
    validator = interface.envelope_validator(event_type) if isinstance(event_type, str) else None
    if validator is None:
        return []
    errors = (error for error in validator.iter_errors(dict(event)) if list(error.instance_path)[:1] != ["data"])
    return [failure(Group.ENVELOPE, f"published envelope schema: {reason}") for reason in _errors(errors)]


def check_subject(subject: str, event: Mapping[str, Any], *, tenant: str, interface: Interface) -> list[Finding]:
    """The subject is a channel address for `tenant`, carrying the event's type, with parameters that agree."""
    matches = [(channel, params) for channel in interface.channels
               if (params := channel.match(subject, tenant=tenant)) is not None]
    if not matches:
        addresses = ", ".join(sorted({channel.address for channel in interface.channels}))
        return [failure(Group.SUBJECT, f"subject {subject!r} is no channel address of the published interface "
                                       f"for tenant {tenant!r} ({addresses})")]
    event_type = event.get("type")
    carrying = [(channel, params) for channel, params in matches if event_type in channel.types]
    findings: list[Finding] = []
    if not carrying:
        channel = matches[0][0]
        findings.append(failure(Group.SUBJECT, f"type {event_type!r} is not published on {subject!r}: channel "
                                               f"{channel.name!r} carries {', '.join(sorted(channel.types))}"))
    channel, params = (carrying or matches)[0]
    for name, pointer in channel.locations.items():
        value = _pointer(event, pointer)
        if name in params and value != params[name]:
            shown = "missing" if value is _MISSING else repr(value)
            findings.append(failure(Group.SUBJECT, f"the subject's {{{name}}} token {params[name]!r} is not the "
                                                   f"event's {pointer.lstrip('/')} ({shown})"))
    return findings


def check_schema(event: Mapping[str, Any], *, interface: Interface) -> list[Finding]:
    """`data` against the published JSON Schema of the event's `type`."""
    event_type = event.get("type")
    if not isinstance(event_type, str):
        return []  # the envelope check reports the type itself
    validator = interface.data_validator(event_type)
    if validator is None:
        return [failure(Group.SCHEMA, f"unknown type {event_type!r}: the interface publishes no schema for it")]
    if "data" not in event:
        return [failure(Group.SCHEMA, f"no data: the interface publishes {event_type} with a JSON data payload")]
    return [failure(Group.SCHEMA, f"{event_type}: {reason}")
            for reason in _errors(validator.iter_errors(event["data"]), root="data")]


_MISSING: Final = object()


def _pointer(document: Mapping[str, Any], pointer: str) -> Any:
    """RFC 6901 JSON pointer into an object (`/subject`), or `_MISSING`."""
    node: Any = document
    for raw in pointer.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _errors(errors: Iterable[Any], *, root: str = "", whole: str = "the event") -> list[str]:
    """`<path>: <message>` for the first few validation errors (`data.offer.options[0].workers: ...`)."""
    reasons: list[str] = []
    for error in errors:
        if len(reasons) == MAX_ERRORS_PER_CHECK:
            reasons.append("(more errors not shown)")
            break
        path = root
        for part in error.instance_path:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        reasons.append(f"{path or whole}: {error.message}")
    return reasons
