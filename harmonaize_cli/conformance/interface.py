"""The published tenant interface a feed is checked against: the AsyncAPI 3.0 document and its JSON Schemas.

Why read the documents rather than the contract's pydantic models: the kit is for a provider that implements the
interface without our code, so what counts is what was published. The channel addresses, which event types each
channel carries, the envelope and header schemas and the per-type payload schemas all come from the files; nothing
here knows an event kind by name. By default the documents are the ones this install generates
(`harmonaize.asyncapi.generated_files`, byte for byte the committed `docs/asyncapi/`); `--spec DIR` reads a published
copy instead (a directory with `asyncapi.json` and `schemas/<type>.json`).

Validators are compiled once per type, on first use: a feed carries a handful of types and thousands of events.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jsonschema_rs

__all__ = ["Channel", "Interface", "InterfaceError", "load_interface"]

DOCUMENT_FILE: Final = "asyncapi.json"
SCHEMAS_DIR: Final = "schemas"
_PARAMETER = re.compile(r"\{([A-Za-z0-9_.-]+)\}")
_TOKEN = r"[^.*>\s]+"
"""What a parameter stands for in an address: exactly one subject token, never a wildcard."""
_PAYLOAD_LOCATION = "$message.payload#"


class InterfaceError(ValueError):
    """The published documents cannot be read or do not describe a usable interface (a bad `--spec`)."""


@dataclass(frozen=True, slots=True)
class Channel:
    """One channel of the document: its address pattern, the event types it carries, where parameters come from."""

    name: str
    address: str
    types: frozenset[str]
    locations: Mapping[str, str]
    """Parameter name -> JSON pointer into the event (`/subject`), from the parameter's `location`."""

    def match(self, subject: str, *, tenant: str) -> dict[str, str] | None:
        """The parameters of `subject` when it is an address of this channel for `tenant`, else None."""
        names, pattern = _address_pattern(self.address, tenant)
        matched = pattern.fullmatch(subject)
        if matched is None:
            return None
        return dict(zip(names, matched.groups(), strict=True))


@functools.lru_cache(maxsize=256)
def _address_pattern(address: str, tenant: str) -> tuple[tuple[str, ...], re.Pattern[str]]:
    """(parameter names, regex) of an address: `{tenant}` stands for `tenant` itself, any other parameter for one
    subject token."""
    parts = _PARAMETER.split(address)  # literal, name, literal, name, ..., literal
    names = tuple(parts[1::2])
    regex = "".join(
        re.escape(part) if index % 2 == 0 else f"({re.escape(tenant) if part == 'tenant' else _TOKEN})"
        for index, part in enumerate(parts)
    )
    return names, re.compile(regex)


class Interface:
    """The document and schemas, with compiled validators for payloads, envelopes and headers."""

    def __init__(self, document: Mapping[str, Any], schemas: Mapping[str, Mapping[str, Any]], *, origin: str) -> None:
        self.document = document
        self.origin = origin
        """Where the documents came from, for the report ("built-in" or the `--spec` directory)."""
        self._schemas = dict(schemas)
        self._components: Mapping[str, Any] = document.get("components", {})
        self._messages = _messages_by_type(document)
        self.channels = _channels(document)
        missing = sorted(set(self._messages) - set(self._schemas))
        if missing:
            raise InterfaceError(f"{origin}: no JSON Schema in {SCHEMAS_DIR}/ for {', '.join(missing)}")
        self._data: dict[str, jsonschema_rs.Validator] = {}
        self._envelope: dict[str, jsonschema_rs.Validator] = {}
        self._headers: dict[str, jsonschema_rs.Validator] = {}

    @property
    def types(self) -> frozenset[str]:
        """Every event type the document publishes."""
        return frozenset(self._messages)

    def content_type(self, event_type: str) -> str | None:
        """The message's content type (or the document's default)."""
        message = self._messages.get(event_type, {})
        value = message.get("contentType", self.document.get("defaultContentType"))
        return value if isinstance(value, str) else None

    def data_validator(self, event_type: str) -> jsonschema_rs.Validator | None:
        """The standalone JSON Schema of `data` for `event_type`; None for a type the interface does not publish."""
        if event_type not in self._schemas:
            return None
        if event_type not in self._data:
            self._data[event_type] = _compile(self._schemas[event_type], what=f"{event_type}.json")
        return self._data[event_type]

    def envelope_validator(self, event_type: str) -> jsonschema_rs.Validator | None:
        """The message payload schema (the whole CloudEvent) of `event_type`, resolved inside the document."""
        return self._component(event_type, "payload", self._envelope)

    def headers_validator(self, event_type: str) -> jsonschema_rs.Validator | None:
        """The message headers schema of `event_type` (the NATS headers every event carries)."""
        return self._component(event_type, "headers", self._headers)

    def _component(
        self, event_type: str, part: str, cache: dict[str, jsonschema_rs.Validator]
    ) -> jsonschema_rs.Validator | None:
        if event_type in cache:
            return cache[event_type]
        schema = self._messages.get(event_type, {}).get(part)
        if not isinstance(schema, Mapping):
            return None
        # AsyncAPI 3.0's default schema format is JSON Schema draft-07, with refs into the document's components.
        root = {**schema, "components": self._components}
        cache[event_type] = _compile(root, what=f"{event_type} {part}", draft7=True)
        return cache[event_type]


def load_interface(directory: Path | None = None) -> Interface:
    """The documents in `directory` (`asyncapi.json`, `schemas/*.json`), or this install's own when None."""
    if directory is None:
        from harmonaize.asyncapi import generated_files

        files = {name: json.loads(text) for name, text in generated_files().items()}
        document = files.pop(DOCUMENT_FILE)
        schemas = {_type_of(name): schema for name, schema in files.items() if name.startswith(f"{SCHEMAS_DIR}/")}
        return Interface(document, schemas, origin="built-in")
    if not directory.is_dir():
        raise InterfaceError(f"--spec: {directory} is not a directory")
    document = _read_json(directory / DOCUMENT_FILE)
    version = str(document.get("asyncapi", ""))
    if not version.startswith("3."):
        raise InterfaceError(f"{directory / DOCUMENT_FILE}: not an AsyncAPI 3 document (asyncapi: {version!r})")
    schemas = {path.name.removesuffix(".json"): _read_json(path)
               for path in sorted((directory / SCHEMAS_DIR).glob("*.json"))}
    return Interface(document, schemas, origin=str(directory))


def _type_of(name: str) -> str:
    return name.removeprefix(f"{SCHEMAS_DIR}/").removesuffix(".json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InterfaceError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise InterfaceError(f"{path}: not a JSON object")
    return value


def _compile(schema: Mapping[str, Any], *, what: str, draft7: bool = False) -> jsonschema_rs.Validator:
    try:
        if draft7:
            return jsonschema_rs.Draft7Validator(dict(schema), validate_formats=True, offline=True)
        return jsonschema_rs.validator_for(dict(schema), validate_formats=True, offline=True)
    except (ValueError, jsonschema_rs.ReferencingError) as exc:
        raise InterfaceError(f"the published schema of {what} does not compile: {exc}") from exc


def _resolve(document: Mapping[str, Any], value: Any) -> Any:
    """Follow a local `$ref` (`#/components/...`) once, as AsyncAPI's own references are."""
    if isinstance(value, Mapping) and isinstance(value.get("$ref"), str) and value["$ref"].startswith("#/"):
        node: Any = document
        for part in value["$ref"][2:].split("/"):
            if not isinstance(node, Mapping) or part not in node:
                raise InterfaceError(f"the document's reference {value['$ref']} resolves to nothing")
            node = node[part]
        return node
    return value


def _messages_by_type(document: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Every message of the document by its `name`, which is the CloudEvents `type` it carries."""
    messages: dict[str, Mapping[str, Any]] = {}
    for key, message in document.get("components", {}).get("messages", {}).items():
        message = _resolve(document, message)
        name = message.get("name") if isinstance(message, Mapping) else None
        if not isinstance(name, str):
            raise InterfaceError(f"message {key!r} has no name (the CloudEvents type it carries)")
        messages[name] = message
    if not messages:
        raise InterfaceError("the document publishes no messages")
    return messages


def _channels(document: Mapping[str, Any]) -> tuple[Channel, ...]:
    channels = []
    for name, channel in document.get("channels", {}).items():
        channel = _resolve(document, channel)
        address = channel.get("address") if isinstance(channel, Mapping) else None
        if not isinstance(address, str):
            raise InterfaceError(f"channel {name!r} has no address")
        messages = channel.get("messages", {}).values()
        types = frozenset(str(_resolve(document, message).get("name")) for message in messages)
        locations = {}
        for parameter, spec in channel.get("parameters", {}).items():
            location = _resolve(document, spec).get("location")
            if isinstance(location, str) and location.startswith(_PAYLOAD_LOCATION):
                locations[parameter] = location.removeprefix(_PAYLOAD_LOCATION)
        channels.append(Channel(name=name, address=address, types=types, locations=locations))
    if not channels:
        raise InterfaceError("the document has no channels")
    return tuple(channels)
