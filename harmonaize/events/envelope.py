"""The CloudEvents 1.0 envelope every HarmonAIze event travels in (JSON structured mode).

Why CloudEvents: it is the one vendor-neutral event envelope with bindings for NATS, HTTP and Kafka, SDKs in every
language a tenant might write a controller in, and an `id` that JetStream can de-duplicate on. We implement the
envelope as a pydantic model instead of using the `cloudevents` SDK at runtime, so that the contract stays
stdlib + pydantic and the payload is typed end to end: `CloudEvent[Failure].data` is a `Failure`, not a dict.
The tests check that the official SDK reads what we write.

Design decisions:

* One content mode, structured JSON (`application/cloudevents+json`): the whole event is the message body, so
  JetStream stores and replays it unchanged and no header mapping can drift.
* `type` is derived from the payload model (`io.harmonaize.<kind>.v<version>`) and checked against it, so a
  `Failure` can never travel as a carbon event. `parse_event` goes the other way, dispatching on `type` through
  the immutable registry.
* `subject` is the job id, validated like every id, because it is what a tenant controller routes on.
* `id` defaults to a UUIDv7 (time-ordered, see `harmonaize.timeids`) but any visible-ASCII string is accepted on
  input, as the spec allows; it is the de-duplication key.
* `time` is an aware UTC datetime, RFC 3339 with `Z` on the wire.
* Extensions are kept, never dropped: CloudEvents lets intermediaries add attributes, and a consumer that silently
  discarded them would break trace propagation. Names must follow the spec (lowercase ASCII letters and digits,
  at most 20 characters) and values must be CloudEvents scalars (string, 32-bit integer, boolean); anything else
  is refused. The W3C distributed-tracing extension (`traceparent`, `tracestate`) is modelled and validated.
* Parsing never trusts its input: size is bounded before decoding, and every failure becomes an `EventError`
  whose message names the offending field (`data.confidence`), so a consumer can dead-letter and log it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Generic, Literal, Self, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from harmonaize.events.base import EventData
from harmonaize.events.errors import InvalidEventError, UnknownEventTypeError
from harmonaize.events.fields import UtcDatetime
from harmonaize.events.registry import DEFAULT_REGISTRY, EventRegistry
from harmonaize.ids import validate_id
from harmonaize.timeids import uuid7

__all__ = [
    "CONTENT_TYPE",
    "DATA_CONTENT_TYPE",
    "MAX_EVENT_BYTES",
    "SPEC_VERSION",
    "CloudEvent",
    "ExtensionValue",
    "make_event",
    "parse_event",
    "parse_event_as",
]

CONTENT_TYPE = "application/cloudevents+json"
DATA_CONTENT_TYPE: Final = "application/json"
SPEC_VERSION: Final = "1.0"
MAX_EVENT_BYTES = 1024 * 1024
"""nats-server's default max_payload: nothing larger can have come off the bus, so refuse it before decoding."""

MAX_EXTENSIONS = 16
MAX_EXTENSION_STRING = 1024
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

_EXTENSION_NAME_RE = re.compile(r"[a-z0-9]{1,20}", re.ASCII)
_URI_CHARS = r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})"
_TRACEPARENT_RE = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<parent_id>[0-9a-f]{16})-(?P<flags>[0-9a-f]{2})"
    r"(?P<rest>-[0-9a-f-]*)?",
    re.ASCII,
)

ExtensionValue = str | int | bool


def _check_traceparent(value: str) -> str:
    """W3C Trace Context `traceparent`: version 00 exactly; later versions may append `-...`; ff is invalid."""
    match = _TRACEPARENT_RE.fullmatch(value)
    if match is None:
        raise ValueError("traceparent must look like 00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>")
    if match["version"] == "ff":
        raise ValueError("traceparent version ff is invalid")
    if match["version"] == "00" and match["rest"]:
        raise ValueError("traceparent version 00 has exactly four fields")
    if set(match["trace_id"]) == {"0"}:
        raise ValueError("traceparent trace-id must not be all zeros")
    if set(match["parent_id"]) == {"0"}:
        raise ValueError("traceparent parent-id must not be all zeros")
    return value


def _check_job_subject(value: str) -> str:
    return validate_id("job", value)


EventIdStr = Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{1,128}$")]
UriReference = Annotated[str, StringConstraints(pattern=rf"^{_URI_CHARS}+$", max_length=512)]
AbsoluteUri = Annotated[str, StringConstraints(pattern=rf"^[A-Za-z][A-Za-z0-9+.\-]*:{_URI_CHARS}+$", max_length=512)]
EventTypeName = Annotated[str, StringConstraints(pattern=r"^io\.harmonaize\.[a-z][a-z0-9_]{0,31}\.v[1-9][0-9]{0,3}$")]
JobSubject = Annotated[str, AfterValidator(_check_job_subject)]
TraceParent = Annotated[str, StringConstraints(max_length=256), AfterValidator(_check_traceparent)]
TraceState = Annotated[str, StringConstraints(pattern=r"^[\x20-\x7e]*$", max_length=512)]

DataT = TypeVar("DataT", bound=EventData)


def _now() -> datetime:
    return datetime.now(UTC)


class CloudEvent(BaseModel, Generic[DataT]):
    """A CloudEvents 1.0 event whose `data` is a HarmonAIze payload; parametrise as `CloudEvent[Failure]`."""

    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)

    specversion: Literal["1.0"] = SPEC_VERSION
    id: EventIdStr = Field(default_factory=uuid7)
    source: UriReference = Field(min_length=1)
    type: EventTypeName
    subject: JobSubject
    time: UtcDatetime = Field(default_factory=_now)
    datacontenttype: Literal["application/json"] = DATA_CONTENT_TYPE
    dataschema: AbsoluteUri | None = None
    traceparent: TraceParent | None = None
    tracestate: TraceState | None = None
    data: DataT

    @model_validator(mode="before")
    @classmethod
    def _type_from_data(cls, values: Any) -> Any:
        """Let producers omit `type`: the payload model already says which type it is."""
        if isinstance(values, Mapping) and "type" not in values and isinstance(values.get("data"), EventData):
            return {**values, "type": values["data"].event_type()}
        return values

    @model_validator(mode="after")
    def _check_type_and_extensions(self) -> Self:
        if isinstance(self.data, EventData) and self.type != self.data.event_type():
            raise ValueError(
                f"type {self.type!r} does not match the data model {type(self.data).__name__} "
                f"({self.data.event_type()!r})"
            )
        extensions = self.model_extra or {}
        if len(extensions) > MAX_EXTENSIONS:
            raise ValueError(f"at most {MAX_EXTENSIONS} extension attributes, got {len(extensions)}")
        for name, value in extensions.items():
            _check_extension(name, value)
        return self

    @property
    def extensions(self) -> dict[str, ExtensionValue]:
        """Extension attributes other than the modelled `traceparent`/`tracestate`, as received."""
        return dict(self.model_extra or {})

    def to_json_dict(self) -> dict[str, Any]:
        """The structured-mode JSON object (absent optional attributes omitted, as the spec prefers to null)."""
        return self.model_dump(mode="json", exclude=self._unset_optionals(), serialize_as_any=True)

    def to_json_bytes(self) -> bytes:
        """The structured-mode body to publish with content type `application/cloudevents+json`."""
        return self.model_dump_json(exclude=self._unset_optionals(), serialize_as_any=True).encode("utf-8")

    def _unset_optionals(self) -> set[str]:
        return {name for name in ("dataschema", "traceparent", "tracestate") if getattr(self, name) is None}


@functools.cache
def _envelope_class(model: type[DataT]) -> type[CloudEvent[DataT]]:
    """`CloudEvent[model]`, looked up once per model: pydantic's own cache of parametrised generics computes its key on
    every subscription, which would be once per event made or decoded."""
    return CloudEvent[model]  # type: ignore[valid-type]


_CORE_ATTRIBUTES = frozenset(CloudEvent.model_fields)
"""The envelope's own attribute names (cheaper than a class attribute lookup on the model, which every attribute of
every decoded event would cost)."""


def _check_extension(name: object, value: object) -> None:
    """Refuse what CloudEvents forbids for extensions, and binary data, which this contract never carries."""
    if name == "data_base64":
        raise ValueError("data_base64 (binary data) is not supported: HarmonAIze events carry JSON data")
    if not isinstance(name, str) or _EXTENSION_NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"invalid extension attribute name {str(name)[:40]!r}: CloudEvents names are 1-20 lowercase ASCII "
            "letters or digits"
        )
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not _INT32_MIN <= value <= _INT32_MAX:
            raise ValueError(f"extension {name!r}: integers must fit in 32 bits (got {value})")
        return
    if isinstance(value, str):
        if len(value) > MAX_EXTENSION_STRING:
            raise ValueError(f"extension {name!r}: string longer than {MAX_EXTENSION_STRING} characters")
        return
    raise ValueError(f"extension {name!r}: value must be a string, integer or boolean, got {type(value).__name__}")


def make_event(
    data: DataT,
    *,
    source: str,
    subject: str,
    event_id: str | None = None,
    time: datetime | None = None,
    dataschema: str | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
    extensions: Mapping[str, ExtensionValue] | None = None,
) -> CloudEvent[DataT]:
    """Wrap a payload in an envelope whose `type` comes from the payload's model; id and time default to now.

    Raises InvalidEventError naming the field when an attribute is malformed.
    """
    attributes: dict[str, Any] = {"source": source, "subject": subject, "data": data}
    optional = {
        "id": event_id,
        "time": time,
        "dataschema": dataschema,
        "traceparent": traceparent,
        "tracestate": tracestate,
    }
    attributes.update({name: value for name, value in optional.items() if value is not None})
    for name, value in (extensions or {}).items():
        if name in _CORE_ATTRIBUTES:
            raise InvalidEventError(data.event_type(), [(name, "is a core attribute, not an extension")])
        attributes[name] = value
    envelope = _envelope_class(type(data))
    try:
        return envelope.model_validate(attributes)
    except ValidationError as exc:
        raise InvalidEventError.from_pydantic(data.event_type(), exc.errors()) from exc


def parse_event(
    raw: bytes | bytearray | memoryview | str | Mapping[str, Any],
    *,
    registry: EventRegistry = DEFAULT_REGISTRY,
) -> CloudEvent[Any]:
    """Decode a structured-mode event, choosing the data model by its `type`.

    Raises UnknownEventTypeError for a type (or version) the registry does not know, and InvalidEventError, which
    names the offending fields, for anything else that is wrong.
    """
    attributes = _load_object(raw)
    model = registry.model_for(_event_type_of(attributes))
    return _validate(attributes, model)


def parse_event_as(
    raw: bytes | bytearray | memoryview | str | Mapping[str, Any],
    model: type[DataT],
) -> CloudEvent[DataT]:
    """Decode an event that must be of one particular model (a typed handler's input)."""
    attributes = _load_object(raw)
    event_type = _event_type_of(attributes)
    if event_type != model.event_type():
        raise UnknownEventTypeError(event_type, f"expected {model.event_type()}")
    return _validate(attributes, model)


def _load_object(raw: bytes | bytearray | memoryview | str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        attributes: object = raw
    else:
        if len(raw) > MAX_EVENT_BYTES:
            raise InvalidEventError(None, [("<event>", f"larger than {MAX_EVENT_BYTES} bytes")])
        try:
            attributes = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidEventError(None, [("<event>", f"not valid UTF-8 JSON ({exc})")]) from exc
    if not isinstance(attributes, Mapping):
        raise InvalidEventError(None, [("<event>", f"must be a JSON object, got {type(attributes).__name__}")])
    specversion = attributes.get("specversion")
    if specversion != SPEC_VERSION:
        shown = repr(specversion)[:40] if "specversion" in attributes else "missing"
        raise InvalidEventError(attributes.get("type"), [("specversion", f"must be '1.0' (got {shown})")])
    for name in attributes:
        if name not in _CORE_ATTRIBUTES:
            try:
                _check_extension(name, attributes[name])
            except ValueError as exc:
                raise InvalidEventError(attributes.get("type"), [(str(name)[:40], str(exc))]) from None
    return attributes


def _event_type_of(attributes: Mapping[str, Any]) -> object:
    if "type" not in attributes:
        raise InvalidEventError(None, [("type", "missing")])
    return attributes["type"]


def _validate(attributes: Mapping[str, Any], model: type[DataT]) -> CloudEvent[DataT]:
    envelope = _envelope_class(model)
    try:
        return envelope.model_validate(attributes)
    except ValidationError as exc:
        raise InvalidEventError.from_pydantic(attributes.get("type"), exc.errors()) from exc
