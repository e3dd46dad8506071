"""The tenant event interface as an AsyncAPI 3.0 document, built from the contract's own models and subjects.

Why generate it: a tenant writing a controller in another language needs the subjects, the envelope and every
payload's schema, and a hand-written copy would drift from the code the first time a field is added. Everything here
is derived from the registry (`harmonaize.events.registry`), the envelope model and `harmonaize.subjects`; the only
hand-written parts are prose and one example payload per event type, and each example is validated by its pydantic
model as it is built, so an example that no longer fits its model fails the build instead of misleading a reader.

Pure: the functions return dicts and text; `harmonaize asyncapi` (harmonaize_cli/asyncapi_command.py) writes or
checks the files. The text is canonical JSON (sorted keys, two-space indent, one trailing newline), so a committed
copy can be compared byte for byte. Payload schemas in the document use JSON Schema draft-07 vocabulary (AsyncAPI
3.0's default schema format); the standalone per-type files are draft 2020-12, as pydantic emits them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from pydantic.json_schema import models_json_schema

from harmonaize import __version__
from harmonaize.events import (
    CONTENT_TYPE,
    CONTROL_PLANE_SOURCE,
    DEFAULT_REGISTRY,
    CloudEvent,
    EventData,
    EventKind,
    EventRegistry,
    agent_source,
    make_event,
)
from harmonaize.events.envelope import MAX_EXTENSION_STRING
from harmonaize.ids import ID_PATTERN
from harmonaize.subjects import TENANT_ROOT, tenant_event_subject, tenant_events_filter

__all__ = [
    "ASYNCAPI_VERSION",
    "DOCUMENT_FILE",
    "EXAMPLE_DATA",
    "JSON_SCHEMA_DIALECT",
    "SCHEMAS_DIR",
    "build_document",
    "build_schema_files",
    "events_address",
    "generated_files",
    "render_json",
    "schema_file_name",
]

ASYNCAPI_VERSION: Final = "3.0.0"
JSON_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"
DOCUMENT_FILE: Final = "asyncapi.json"
SCHEMAS_DIR: Final = "schemas"
DOCUMENT_ID: Final = "urn:harmonaize:tenant-events"

_SCHEMAS_REF = "#/components/schemas/{model}"
_HEADERS_SCHEMA = "NatsHeaders"
_SECURITY_SCHEME = "tenantNkey"
_LOCAL_SERVER = "local"
_EXAMPLE_TENANT, _EXAMPLE_JOB = "acme", "train-7"
_EXAMPLE_TIME = datetime(2025, 3, 14, 2, 0, 5, tzinfo=UTC)
_EXAMPLE_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
_EXAMPLE_HOST = "h-1a2b3c4d"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
"""CloudEvents' Integer type is a signed 32-bit integer (the envelope refuses wider extension values)."""
_DRAFT_2020_ONLY = ("$dynamicRef", "$dynamicAnchor", "dependentRequired", "dependentSchemas", "unevaluatedItems",
                    "unevaluatedProperties")
"""2020-12 keywords with no draft-07 meaning; pydantic does not emit them for the contract's models today."""

EXAMPLE_DATA: Final[Mapping[str, tuple[str, Mapping[str, Any]]]] = {
    "io.harmonaize.capacity.v1": (CONTROL_PLANE_SOURCE, {
        "max_workers": 6,
        "as_of": "2025-03-14T02:00:00Z",
        "groups": [{"group": "g-aa11bb", "free_gpus": "some"}, {"group": "g-cc22dd", "free_gpus": "few"}],
    }),
    "io.harmonaize.carbon.v1": (agent_source(_EXAMPLE_HOST), {
        "region": "DE",
        "g_per_kwh": 312.5,
        "observed_at": "2025-03-14T02:00:00Z",
        "forecast": [{"at": "2025-03-14T03:00:00Z", "g_per_kwh": 280.0},
                     {"at": "2025-03-14T04:00:00Z", "g_per_kwh": 190.0}],
    }),
    "io.harmonaize.congestion.v1": (agent_source(_EXAMPLE_HOST), {
        "level": "high",
        "slowdown": 2.5,
        "scope": "inter_group",
        "groups": ["g-aa11bb", "g-cc22dd"],
        "since": "2025-03-14T01:58:00Z",
        "expected_until": "2025-03-14T02:30:00Z",
    }),
    "io.harmonaize.directive.v1": (CONTROL_PLANE_SOURCE, {
        "version": 3,
        "state": "applied",
        "checkpoint_requests": 1,
        "checkpoint_interval_steps": 200,
        "compression": "fp16",
        "reason": "congestion between groups",
        "step": 1200,
        "at": "2025-03-14T02:00:04Z",
    }),
    "io.harmonaize.failure.v1": (agent_source(_EXAMPLE_HOST), {
        "kind": "predicted_failure",
        "host": _EXAMPLE_HOST,
        "gpu_index": 2,
        "detected_at": "2025-03-14T02:00:00Z",
        "severity": "warning",
        "eta": "2025-03-14T02:10:00Z",
        "confidence": 0.8,
        "reason": "ecc_errors_rising",
    }),
    "io.harmonaize.job.v1": (CONTROL_PLANE_SOURCE, {
        "epoch": 4,
        "world_size": 3,
        "parallel_plan": "ddp",
        "step": 1200,
        "resumed_from_step": None,
        "at": "2025-03-14T02:00:03Z",
    }),
    "io.harmonaize.maintenance.v1": (agent_source(_EXAMPLE_HOST), {
        "notice_id": "mx-2025-0314-01",
        "kind": "live_migrate",
        "status": "scheduled",
        "window": {"not_before": "2025-03-14T03:00:00Z", "not_after": "2025-03-14T03:30:00Z"},
        "hosts": [_EXAMPLE_HOST],
        "early_approval": True,
    }),
    "io.harmonaize.negotiation.v1": (CONTROL_PLANE_SOURCE, {
        "negotiation_id": "0195946c-6a00-7b3e-9f1d-2c4e6a8b0d12",
        "kind": "scale",
        "state": "offered",
        "round": 1,
        "offer": {
            "options": [{"workers": 3, "reason": "one more GPU is free in the job's group"}],
            "expires_at": "2025-03-14T02:01:00Z",
        },
        "at": "2025-03-14T02:00:01Z",
    }),
    "io.harmonaize.topology.v1": (agent_source(_EXAMPLE_HOST), {
        "nodes": [
            {"host": _EXAMPLE_HOST, "group": "g-aa11bb", "gpus": 8, "gpu_class": "xlarge"},
            {"host": "h-5e6f7a8b", "group": "g-cc22dd", "gpus": 8, "gpu_class": "xlarge"},
        ],
        "groups": [
            {"group": "g-aa11bb", "intra_bandwidth": "very_high"},
            {"group": "g-cc22dd", "intra_bandwidth": "very_high"},
        ],
        "links": [{"a": "g-aa11bb", "b": "g-cc22dd", "bandwidth": "medium"}],
    }),
}
"""One example per event type: (CloudEvents source, the `data` as it travels). Validated by the model when built."""

_ATTRIBUTE_NOTES: Final[Mapping[str, str]] = {
    "specversion": "CloudEvents version; always 1.0.",
    "id": "Unique per event (a UUIDv7 from the provider) and the de-duplication key: delivery is at least once, so "
          "a consumer drops an id it has already handled. Also sent as the `Nats-Msg-Id` header.",
    "source": "Who published it: `/hz/provider/control-plane`, or `/hz/provider/agent/h-<hex>` for a host agent, "
              "named by the pseudonym this tenant knows the host by.",
    "subject": "The job the event is about (its id); the same as the last token of the NATS subject.",
    "time": "When it happened, RFC 3339 in UTC (`Z`); up to nine fractional digits are accepted.",
    "datacontenttype": "The content type of `data`; always application/json.",
    "traceparent": "W3C Trace Context (CloudEvents distributed-tracing extension); also sent as a NATS header.",
    "tracestate": "W3C Trace Context vendor state, with `traceparent`; also sent as a NATS header.",
}


def events_address(kind: EventKind | None = None) -> str:
    """`hz.t.{tenant}.events.<kind>.{job}` (`{kind}` left as a parameter when `kind` is None), checked against
    `harmonaize.subjects` so the document and the code that builds subjects cannot drift apart."""
    template = f"{TENANT_ROOT}.{{tenant}}.events.{{kind}}.{{job}}"
    for sample in EventKind:
        built = template.format(tenant=_EXAMPLE_TENANT, kind=sample.value, job=_EXAMPLE_JOB)
        if built != tenant_event_subject(_EXAMPLE_TENANT, sample, _EXAMPLE_JOB):
            raise RuntimeError(f"the AsyncAPI address {template!r} no longer matches harmonaize.subjects ({built})")
    if template.format(tenant=_EXAMPLE_TENANT, kind="*", job="*") != tenant_events_filter(_EXAMPLE_TENANT):
        raise RuntimeError(f"the AsyncAPI address {template!r} no longer matches harmonaize.subjects' filter")
    return template if kind is None else template.replace("{kind}", kind.value)


def schema_file_name(model: type[EventData]) -> str:
    """`<type>.json`, e.g. `io.harmonaize.failure.v1.json`: the standalone JSON Schema of one type's `data`."""
    return f"{model.event_type()}.json"


def build_schema_files(registry: EventRegistry = DEFAULT_REGISTRY) -> dict[str, dict[str, Any]]:
    """One draft 2020-12 JSON Schema of `data` per event type, exactly as pydantic emits it (plus `$schema`)."""
    return {
        schema_file_name(model): {"$schema": JSON_SCHEMA_DIALECT, **model.model_json_schema()}
        for model in _models(registry)
    }


def build_document(
    registry: EventRegistry = DEFAULT_REGISTRY,
    *,
    examples: Mapping[str, tuple[str, Mapping[str, Any]]] = EXAMPLE_DATA,
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every event type in `registry`, as a tenant receives them.

    Raises ValueError when a registered type has no example, or its example does not validate.
    """
    models = _models(registry)
    schemas, envelopes = _component_schemas(models)
    by_kind: dict[EventKind, list[type[EventData]]] = {}
    for model in models:
        by_kind.setdefault(model.KIND, []).append(model)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for kind, versions in sorted(by_kind.items()):
        channels[kind.value] = _channel(kind, versions)
        operations[_operation_key(kind)] = _operation(kind, versions)
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": DOCUMENT_ID,
        "info": _info(),
        "defaultContentType": CONTENT_TYPE,
        "servers": {_LOCAL_SERVER: _local_server()},
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "messages": {_message_key(model): _message(model, envelopes[model], examples) for model in models},
            "parameters": _parameters(),
            "securitySchemes": {_SECURITY_SCHEME: _security_scheme()},
        },
    }


def render_json(value: Any) -> str:
    """Canonical JSON text: sorted keys, two-space indent, UTF-8 characters kept, one trailing newline."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def generated_files(registry: EventRegistry = DEFAULT_REGISTRY) -> dict[str, str]:
    """Every file `harmonaize asyncapi` writes, by path relative to its output directory (`/`-separated)."""
    files = {DOCUMENT_FILE: render_json(build_document(registry))}
    for name, schema in build_schema_files(registry).items():
        files[f"{SCHEMAS_DIR}/{name}"] = render_json(schema)
    return dict(sorted(files.items()))


# --- parts of the document ----------------------------------------------------------------------------------------


def _models(registry: EventRegistry) -> list[type[EventData]]:
    """By kind, then version as a number (`v10` after `v9`, which the sorted type strings would not give)."""
    return sorted(registry, key=lambda model: (model.KIND.value, model.VERSION))


def _info() -> dict[str, Any]:
    return {
        "title": "HarmonAIze tenant events",
        "version": __version__,
        "description": (
            "The events a HarmonAIze provider publishes to each tenant about the tenant's own jobs: topology, "
            "congestion, failures, maintenance, carbon intensity, capacity, negotiation outcomes, the provider's "
            "micro-level directives and job changes.\n\n"
            "Every event is a CloudEvents 1.0 event in structured JSON mode (the whole event is the message body, "
            "content type `application/cloudevents+json`). Its `type` is `io.harmonaize.<kind>.v<version>`, its "
            "`subject` is the job id, and `data` is the payload schema of that type. Hosts and locality groups "
            "appear only as per-tenant pseudonyms (`h-<hex>`, `g-<hex>`).\n\n"
            f"Events are stored in the tenant's JetStream stream on `{TENANT_ROOT}.<tenant>.>` and read through "
            "durable pull consumers the provider creates on request (`PUT /v1/event-consumers/{name}` on the "
            "control-plane API, with the kinds and jobs to filter on, and who keeps the consumer's position: "
            "`broker`, on its disk, or `reader`, in the broker's memory only, re-created after a broker restart "
            "from the stream sequence the reader recorded, `start_after`); delivery is at least once, so consumers "
            "de-duplicate by the CloudEvents `id`. A consumer that meets a `type` it does not know (a newer version) "
            "should settle it and go on rather than stop (the tenant SDK logs it and terminates its delivery).\n\n"
            "Generated from the code by `harmonaize asyncapi`; do not edit by hand."
        ),
        "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
    }


def _local_server() -> dict[str, Any]:
    return {
        "host": "127.0.0.1:4222",
        "protocol": "nats",
        "title": "Local cloud",
        "description": (
            "The broker of a local cloud (`harmonaize up`). It may listen on another port when 4222 is taken: "
            "`HZ_NATS_URL` in the tenant's env file says where."
        ),
        "security": [{"$ref": f"#/components/securitySchemes/{_SECURITY_SCHEME}"}],
    }


def _security_scheme() -> dict[str, Any]:
    return {
        "type": "asymmetricEncryption",
        "description": (
            "NATS nkey authentication: the tenant's user nkey seed (`SU...`, `HZ_TENANT_NATS_SEED`), handed to the "
            "tenant once when it is created and never stored by the provider; the broker holds only the public "
            "key. The user belongs to the tenant's own account, which may subscribe only to "
            f"`{TENANT_ROOT}.<tenant>.>` (and `_INBOX.>`), read its consumers through the JetStream API imported "
            "under the prefix `$JS.hz.API`, and publish no event."
        ),
    }


def _parameters() -> dict[str, Any]:
    id_rule = (
        f"Ids match `{ID_PATTERN}`: lowercase ASCII letters, digits, `_` and `-`, starting with a letter or digit, "
        "at most 63 characters, so an id is always exactly one subject token."
    )
    return {
        "tenant": {
            "description": f"The tenant's id; its credentials reach only subjects under its own id. {id_rule}",
            "examples": [_EXAMPLE_TENANT],
        },
        "job": {
            "description": f"The id of the job the event is about (also the event's `subject`). {id_rule}",
            "examples": [_EXAMPLE_JOB],
            "location": "$message.payload#/subject",
        },
    }


def _channel(kind: EventKind, versions: list[type[EventData]]) -> dict[str, Any]:
    return {
        "address": events_address(kind),
        "title": f"{kind.value} events",
        "description": _module_summary(versions[-1]),
        "parameters": {name: {"$ref": f"#/components/parameters/{name}"} for name in ("tenant", "job")},
        "messages": {_message_key(model): {"$ref": f"#/components/messages/{_message_key(model)}"}
                     for model in versions},
    }


def _operation(kind: EventKind, versions: list[type[EventData]]) -> dict[str, Any]:
    return {
        "action": "receive",
        "title": f"Receive {kind.value} events",
        "summary": f"A tenant receives the {kind.value} events of its jobs.",
        "channel": {"$ref": f"#/channels/{kind.value}"},
        "messages": [{"$ref": f"#/channels/{kind.value}/messages/{_message_key(model)}"} for model in versions],
    }


def _message(
    model: type[EventData], envelope: str, examples: Mapping[str, tuple[str, Mapping[str, Any]]]
) -> dict[str, Any]:
    event_type = model.event_type()
    return {
        "name": event_type,
        "title": f"{model.__name__} v{model.VERSION}",
        "summary": _first_line(model),
        "description": (
            f"CloudEvents type `{event_type}` on `{events_address(model.KIND)}`; `data` is a "
            f"`{model.__name__}` (standalone schema: `{SCHEMAS_DIR}/{schema_file_name(model)}`)."
        ),
        "contentType": CONTENT_TYPE,
        "headers": {"$ref": _SCHEMAS_REF.format(model=_HEADERS_SCHEMA)},
        "payload": {"$ref": _SCHEMAS_REF.format(model=envelope)},
        "examples": [_example(model, examples)],
    }


def _example(model: type[EventData], examples: Mapping[str, tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    event_type = model.event_type()
    if event_type not in examples:
        raise ValueError(f"no example for {event_type}: add one to EXAMPLE_DATA in {__name__}")
    source, data = examples[event_type]
    instance = model.model_validate_json(json.dumps(data))
    event = make_event(
        instance,
        source=source,
        subject=_EXAMPLE_JOB,
        event_id=_example_id(event_type),
        time=_EXAMPLE_TIME,
        traceparent=_EXAMPLE_TRACEPARENT if source != CONTROL_PLANE_SOURCE else None,
    )
    headers = {"Content-Type": CONTENT_TYPE, "Nats-Msg-Id": event.id}
    if event.traceparent is not None:
        headers["traceparent"] = event.traceparent
    return {
        "name": model.KIND.value,
        "summary": f"A {model.__name__} v{model.VERSION} event about job {_EXAMPLE_JOB}.",
        "headers": headers,
        "payload": event.to_json_dict(),
    }


def _example_id(event_type: str) -> str:
    """A fixed UUIDv7 per type (the example's time, then bits from a hash of the type), so examples are stable."""
    millis = int(_EXAMPLE_TIME.timestamp() * 1000)
    bits = int.from_bytes(hashlib.sha256(event_type.encode()).digest()[:10], "big")  # 80 bits: 12 + 62 used
    rand_a, rand_b = bits >> 68, bits & ((1 << 62) - 1)
    value = millis << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b  # version 7, RFC 9562 variant
    return str(uuid.UUID(int=value))


# --- schemas ------------------------------------------------------------------------------------------------------


def _component_schemas(models: list[type[EventData]]) -> tuple[dict[str, Any], dict[type[EventData], str]]:
    """All schemas under components/schemas (pydantic's `$defs`, referenced there), and each type's envelope name."""
    keys, generated = models_json_schema(
        [(_envelope_model(model), "validation") for model in models], ref_template=_SCHEMAS_REF
    )
    schemas: dict[str, Any] = dict(generated.get("$defs", {}))
    envelopes: dict[type[EventData], str] = {}
    for model in models:
        name = keys[(_envelope_model(model), "validation")]["$ref"].rsplit("/", 1)[-1]
        schemas[name] = _wire_envelope(schemas[name], model)
        envelopes[model] = name
    schemas[_HEADERS_SCHEMA] = _headers_schema()
    for name, schema in schemas.items():
        schemas[name] = _draft07(schema, where=name)
    return schemas, envelopes


def _envelope_model(model: type[EventData]) -> type[CloudEvent[Any]]:
    return CloudEvent[model]  # type: ignore[valid-type]


def _wire_envelope(schema: Mapping[str, Any], model: type[EventData]) -> dict[str, Any]:
    """What pydantic cannot see in the envelope: the fixed `type`, the job-id `subject`, what every event carries.

    `required` lists every attribute a published event always has (`to_json_dict` omits only the optional ones that
    are unset); extension attributes are CloudEvents scalars under lowercase names of at most 20 characters.
    """
    properties = dict(schema["properties"])
    properties["type"] = {"const": model.event_type(), "title": "Type", "type": "string",
                          "description": "The CloudEvents type: which payload `data` is, and its version."}
    properties["subject"] = {**properties["subject"], "pattern": ID_PATTERN}
    for name, note in _ATTRIBUTE_NOTES.items():
        if name in properties:
            properties[name] = {**properties[name], "description": note}
    always = [name for name, field in CloudEvent.model_fields.items() if field.default is not None]
    return {
        **schema,
        "description": f"A CloudEvents 1.0 event (structured JSON mode) whose `data` is a {model.__name__}.",
        "properties": properties,
        "required": [name for name in properties if name in always],
        "propertyNames": {"pattern": "^[a-z0-9]{1,20}$"},
        "additionalProperties": {
            "description": "A CloudEvents extension attribute: a string, a 32-bit integer or a boolean.",
            "anyOf": [
                {"type": "string", "maxLength": MAX_EXTENSION_STRING},
                {"type": "integer", "minimum": _INT32_MIN, "maximum": _INT32_MAX},
                {"type": "boolean"},
            ],
        },
    }


def _headers_schema() -> dict[str, Any]:
    return {
        "title": "NATS headers",
        "description": "Headers of every tenant event as the provider publishes it (JetStream keeps them).",
        "type": "object",
        "properties": {
            "Nats-Msg-Id": {"type": "string", "description": "The CloudEvents `id`: JetStream drops a re-publish "
                                                             "with the same id inside the stream's duplicate window."},
            "Content-Type": {"const": CONTENT_TYPE, "description": "Structured content mode (the CloudEvents NATS "
                                                                  "binding): the body is the whole event as JSON."},
            "traceparent": {"type": "string", "description": "The event's `traceparent`, when it has one."},
            "tracestate": {"type": "string", "description": "The event's `tracestate`, when it has one."},
        },
        "required": ["Content-Type", "Nats-Msg-Id"],
    }


def _draft07(schema: Any, *, where: str) -> Any:
    """The same schema in draft-07 words: `prefixItems` becomes array-form `items`; other 2020-12-only keywords
    have no draft-07 equivalent and are refused, naming the schema, rather than silently meaning nothing."""
    if isinstance(schema, list):
        return [_draft07(item, where=where) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: _draft07(value, where=where) for key, value in schema.items()}
    for keyword in _DRAFT_2020_ONLY:
        if keyword in converted:
            raise ValueError(f"{where}: JSON Schema keyword {keyword!r} has no AsyncAPI (draft-07) equivalent")
    if "prefixItems" in converted:
        tail = converted.pop("items", False)
        converted["items"] = converted.pop("prefixItems")
        converted["additionalItems"] = tail
    return converted


# --- text ---------------------------------------------------------------------------------------------------------


def _message_key(model: type[EventData]) -> str:
    return f"{model.KIND.value}.v{model.VERSION}"


def _operation_key(kind: EventKind) -> str:
    return "receive" + "".join(part.title() for part in kind.value.split("_"))


def _first_line(model: type[EventData]) -> str:
    return (inspect.getdoc(model) or model.__name__).split("\n", 1)[0]


def _module_summary(model: type[EventData]) -> str:
    """The first paragraph of the model's module docstring, on one line: what this kind of event is about."""
    module = sys.modules.get(model.__module__)
    text = inspect.getdoc(module) if module is not None else None
    if not text:
        return _first_line(model)
    return " ".join(text.split("\n\n", 1)[0].split())
