"""The CloudEvents NATS protocol binding: which content mode a received message is in, and the event it carries.

The rules (NATS binding 1.0.3 draft, section 3): on a server with headers (NATS 2.2+), a message whose `Content-Type`
is a CloudEvents format (`application/cloudevents...`, matched case-insensitively) is in structured mode, and the
body is the event in that format (this kit reads the JSON format, `application/cloudevents+json`); any other message
is in binary mode: every attribute in its own `ce-<name>` header, percent-encoded, and the body is `data`.

The binding's 1.0.2 release knew structured mode only and used no headers; a message with neither a CloudEvents
`Content-Type` nor any `ce-` header is read that way, with a warning, because a receiver that follows the current
draft would take it for a binary-mode message without attributes. Whether the mode and content type are the ones the
published interface promises is not decided here (`checks` compares them with the document).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from harmonaize_cli.conformance.findings import Finding, Group, failure, warning

__all__ = ["ContentMode", "Decoded", "Received", "decode", "is_json_media_type", "media_type"]

CLOUDEVENTS_JSON: Final = "application/cloudevents+json"
_CLOUDEVENTS_PREFIX: Final = "application/cloudevents"
_HEADER_PREFIX: Final = "ce-"


class ContentMode(StrEnum):
    STRUCTURED = "structured"
    BINARY = "binary"


@dataclass(frozen=True, slots=True)
class Received:
    """A message as it came off the broker: subject, headers (empty when it had none) and body."""

    subject: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        """A header by name, case-insensitively (NATS header names are, per the binding)."""
        wanted = name.lower()
        return next((value for key, value in self.headers.items() if key.lower() == wanted), None)


@dataclass(frozen=True, slots=True)
class Decoded:
    """The event a message carries, as the JSON format has it (attributes plus `data`), or None if unreadable."""

    mode: ContentMode | None
    event: dict[str, Any] | None
    content_type: str | None
    """The message's `Content-Type` header as received (None when absent)."""
    findings: tuple[Finding, ...] = ()


def media_type(value: str) -> str:
    """`type/subtype` of a content type, lowercased, without parameters."""
    return value.split(";", 1)[0].strip().lower()


def is_json_media_type(value: str) -> bool:
    """JSON data, as CloudEvents' JSON format tells it: `application/json`, `text/json` or any `+json` suffix."""
    kind = media_type(value)
    return kind in ("application/json", "text/json") or kind.endswith("+json")


def decode(received: Received) -> Decoded:
    """Tell the content mode and decode the event; findings name what makes the message unreadable."""
    content_type = received.header("content-type")
    if content_type is not None and media_type(content_type).startswith(_CLOUDEVENTS_PREFIX):
        return _structured(received, content_type)
    if any(key.lower().startswith(_HEADER_PREFIX) for key in received.headers):
        return _binary(received, content_type)
    if content_type is None:
        legacy = warning(
            Group.BINDING,
            f"no Content-Type header: read as structured mode (NATS binding 1.0.2); the binding's current draft reads "
            f"a message without 'Content-Type: {CLOUDEVENTS_JSON}' on NATS 2.2+ as binary mode",
        )
        decoded = _structured(received, None)
        return Decoded(decoded.mode, decoded.event, None, (legacy, *decoded.findings))
    return Decoded(None, None, content_type, (failure(
        Group.BINDING,
        f"Content-Type {content_type!r} is no CloudEvents format and no ce- header is present: neither structured "
        "nor binary mode",
    ),))


def _structured(received: Received, content_type: str | None) -> Decoded:
    if content_type is not None:
        kind = media_type(content_type)
        if kind != CLOUDEVENTS_JSON:
            return Decoded(ContentMode.STRUCTURED, None, content_type, (failure(
                Group.BINDING, f"structured mode in event format {kind!r}: only the JSON format ({CLOUDEVENTS_JSON}) "
                "is defined for the tenant interface (and the NATS binding has no batch mode)",
            ),))
        charset = _parameter(content_type, "charset")
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            return Decoded(ContentMode.STRUCTURED, None, content_type, (failure(
                Group.BINDING, f"Content-Type charset {charset!r}: the JSON format is UTF-8",
            ),))
    try:
        event = _strict_json(received.body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return Decoded(ContentMode.STRUCTURED, None, content_type, (failure(
            Group.BINDING, f"structured-mode body is not UTF-8 ({exc.reason} at byte {exc.start})"),))
    except json.JSONDecodeError as exc:
        return Decoded(ContentMode.STRUCTURED, None, content_type, (failure(
            Group.BINDING, f"structured-mode body is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"),))
    if not isinstance(event, dict):
        return Decoded(ContentMode.STRUCTURED, None, content_type, (failure(
            Group.BINDING, f"structured-mode body is a JSON {_json_kind(event)}, not an object (the JSON format)"),))
    return Decoded(ContentMode.STRUCTURED, event, content_type)


def _binary(received: Received, content_type: str | None) -> Decoded:
    event: dict[str, Any] = {}
    findings: list[Finding] = []
    for key, raw in received.headers.items():
        if not key.lower().startswith(_HEADER_PREFIX):
            continue
        name = key[len(_HEADER_PREFIX):].lower()
        try:
            event[name] = urllib.parse.unquote(_unquote_double_quoted(raw), errors="strict")
        except UnicodeDecodeError:
            findings.append(failure(Group.BINDING, f"header {key!r}: percent-encoding is not valid UTF-8"))
    declared = event.get("datacontenttype")
    data_type = declared if isinstance(declared, str) else content_type
    if received.body:
        if data_type is None or is_json_media_type(data_type):
            try:
                event["data"] = _strict_json(received.body.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                reason = f"binary-mode body is not the JSON its content type says ({exc})"
                findings.append(failure(Group.BINDING, reason))
        else:
            try:
                event["data"] = received.body.decode("utf-8")
            except UnicodeDecodeError:
                findings.append(failure(Group.BINDING, "binary-mode body is neither JSON nor UTF-8 text"))
    return Decoded(ContentMode.BINARY, event, content_type, tuple(findings))


def _strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: Python's NaN, Infinity and -Infinity are not JSON, whatever json.loads accepts."""

    def refuse(constant: str) -> Any:
        raise json.JSONDecodeError(f"{constant} is not JSON", text, 0)

    return json.loads(text, parse_constant=refuse)


def _unquote_double_quoted(value: str) -> str:
    """RFC 7230 quoted-string unescaping, which the binding asks of a receiver before percent-decoding."""
    text = value.strip()
    if len(text) < 2 or not (text.startswith('"') and text.endswith('"')):
        return text
    out, escaped = [], False
    for char in text[1:-1]:
        if escaped or char != "\\":
            out.append(char)
            escaped = False
        else:
            escaped = True
    return "".join(out)


def _parameter(content_type: str, name: str) -> str | None:
    for part in content_type.split(";")[1:]:
        key, _, value = part.partition("=")
        if key.strip().lower() == name:
            return value.strip().strip('"')
    return None


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
