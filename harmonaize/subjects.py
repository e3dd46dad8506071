"""NATS subject names: the one place that turns tenant, job and host ids into subjects and back.

The scheme is the isolation boundary, so it is built, never formatted by hand:

    hz.t.<tenant>.events.<kind>.<job>     what a tenant may read (CloudEvents, one stream)
    hz.t.<tenant>.jobs.<job>.directives   provider micro-level decisions to a running job
    hz.t.<tenant>.>                       the whole slice a tenant's credentials allow
    hz.p.<token>...                       provider-internal (telemetry, host commands); tenants never reach it

Why every id goes through `validate_id` before it touches a subject: a tenant id of `acme.>` or `*` would turn a
publish into a broadcast or a subscription into a read of every tenant, and a Cyrillic `а` or fullwidth `ａ` would
create a subject that looks like another tenant's in a log. The id alphabet (lowercase ASCII, digits, `_`, `-`)
excludes all of that, so a built subject always has exactly the intended tokens.

Wildcards appear only where a caller explicitly asked for "any": `tenant_events_filter(t)` gives
`hz.t.<t>.events.*.*` (each position a single-token `*`, so a future deeper subject is not silently swallowed),
and only `tenant_slice` and `provider_filter(..., REST)` use `>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from harmonaize.events.kinds import EventKind, UnknownEventKindError, parse_kind
from harmonaize.ids import InvalidIdError, validate_id

__all__ = [
    "ALL_TENANT_EVENTS",
    "ANY",
    "PROVIDER_ROOT",
    "REST",
    "TENANT_ROOT",
    "InvalidSubjectError",
    "JobDirectivesSubject",
    "TenantEventSubject",
    "job_directives_subject",
    "parse_job_directives_subject",
    "parse_tenant_event_subject",
    "provider_filter",
    "provider_subject",
    "tenant_event_subject",
    "tenant_events_filter",
    "tenant_slice",
    "tenant_subject_prefix",
]

TENANT_ROOT: Final = "hz.t"
PROVIDER_ROOT: Final = "hz.p"
ANY: Final = "*"
"""Single-token wildcard, for `provider_filter`."""
REST: Final = ">"
"""Multi-token wildcard, for the last position of `provider_filter`."""

ALL_TENANT_EVENTS: Final = f"{TENANT_ROOT}.*.events.*.*"
"""Every tenant's events and nothing else (e.g. a provider-side auditor); per-tenant streams use `tenant_slice`."""

_EVENTS: Final = "events"
_JOBS: Final = "jobs"
_DIRECTIVES: Final = "directives"


class InvalidSubjectError(ValueError):
    """A subject that is not one of ours, or whose tokens are not valid ids."""

    def __init__(self, subject: object, reason: str) -> None:
        super().__init__(f"invalid subject {subject!r}: {reason}")
        self.subject = subject


@dataclass(frozen=True, slots=True)
class TenantEventSubject:
    """The parts of `hz.t.<tenant>.events.<kind>.<job>`."""

    tenant: str
    kind: EventKind
    job: str

    def __str__(self) -> str:
        return tenant_event_subject(self.tenant, self.kind, self.job)


@dataclass(frozen=True, slots=True)
class JobDirectivesSubject:
    """The parts of `hz.t.<tenant>.jobs.<job>.directives`."""

    tenant: str
    job: str

    def __str__(self) -> str:
        return job_directives_subject(self.tenant, self.job)


def tenant_event_subject(tenant: str, kind: EventKind | str, job: str) -> str:
    """Where a provider publishes a tenant's `kind` events about `job`."""
    return _join(TENANT_ROOT, validate_id("tenant", tenant), _EVENTS, parse_kind(kind).value, validate_id("job", job))


def tenant_events_filter(tenant: str, *, kind: EventKind | str | None = None, job: str | None = None) -> str:
    """A subscription filter within one tenant's events; `None` for kind or job means "any" (`*`)."""
    kind_token = ANY if kind is None else parse_kind(kind).value
    job_token = ANY if job is None else validate_id("job", job)
    return _join(TENANT_ROOT, validate_id("tenant", tenant), _EVENTS, kind_token, job_token)


def parse_tenant_event_subject(subject: str) -> TenantEventSubject:
    """Split a concrete (wildcard-free) tenant event subject, validating every token."""
    tokens = _split(subject, expected=6)
    if tokens[:2] != ["hz", "t"] or tokens[3] != _EVENTS:
        raise InvalidSubjectError(subject, f"expected {TENANT_ROOT}.<tenant>.{_EVENTS}.<kind>.<job>")
    try:
        return TenantEventSubject(
            tenant=validate_id("tenant", tokens[2]), kind=parse_kind(tokens[4]), job=validate_id("job", tokens[5])
        )
    except (InvalidIdError, UnknownEventKindError) as exc:
        raise InvalidSubjectError(subject, str(exc)) from exc


def job_directives_subject(tenant: str, job: str) -> str:
    """Where the provider sends a running job its micro-level directives."""
    return _join(TENANT_ROOT, validate_id("tenant", tenant), _JOBS, validate_id("job", job), _DIRECTIVES)


def parse_job_directives_subject(subject: str) -> JobDirectivesSubject:
    """Split a concrete job directives subject, validating every token."""
    tokens = _split(subject, expected=6)
    if tokens[:2] != ["hz", "t"] or tokens[3] != _JOBS or tokens[5] != _DIRECTIVES:
        raise InvalidSubjectError(subject, f"expected {TENANT_ROOT}.<tenant>.{_JOBS}.<job>.{_DIRECTIVES}")
    try:
        return JobDirectivesSubject(tenant=validate_id("tenant", tokens[2]), job=validate_id("job", tokens[4]))
    except InvalidIdError as exc:
        raise InvalidSubjectError(subject, str(exc)) from exc


def tenant_slice(tenant: str) -> str:
    """Everything one tenant may publish or subscribe to: the only permission its credentials get."""
    return _join(TENANT_ROOT, validate_id("tenant", tenant), REST)


def tenant_subject_prefix(tenant: str) -> str:
    """`hz.t.<tenant>.`: the prefix a tenant's credentials tell it to put on its subjects (`tenant_slice` less `>`)."""
    return _join(TENANT_ROOT, validate_id("tenant", tenant), "")


def provider_subject(*tokens: str) -> str:
    """A concrete provider-internal subject `hz.p.<token>...`; every token must be a valid id."""
    if not tokens:
        raise ValueError("provider_subject needs at least one token")
    return _join(PROVIDER_ROOT, *(validate_id("subject token", token) for token in tokens))


def provider_filter(*tokens: str) -> str:
    """A provider-internal subscription filter: tokens are ids or `ANY`, and the last may be `REST`."""
    if not tokens:
        raise ValueError("provider_filter needs at least one token")
    checked = []
    for position, token in enumerate(tokens):
        if token == ANY or (token == REST and position == len(tokens) - 1):
            checked.append(token)
        else:
            checked.append(validate_id("subject token", token))
    return _join(PROVIDER_ROOT, *checked)


def _join(*tokens: str) -> str:
    return ".".join(tokens)


def _split(subject: object, *, expected: int) -> list[str]:
    if not isinstance(subject, str):
        raise InvalidSubjectError(subject, f"must be a string, got {type(subject).__name__}")
    tokens = subject.split(".")
    if len(tokens) != expected:
        raise InvalidSubjectError(subject, f"expected {expected} dot-separated tokens, got {len(tokens)}")
    return tokens
