"""Subject builders and parsers: round-trips, explicit wildcards, and refusal of every injection attempt."""

from __future__ import annotations

import pytest

from harmonaize.events import EventKind, UnknownEventKindError
from harmonaize.ids import InvalidIdError
from harmonaize.subjects import (
    ALL_TENANT_EVENTS,
    ANY,
    REST,
    InvalidSubjectError,
    JobDirectivesSubject,
    TenantEventSubject,
    job_directives_subject,
    parse_job_directives_subject,
    parse_tenant_event_subject,
    provider_filter,
    provider_subject,
    tenant_event_subject,
    tenant_events_filter,
    tenant_slice,
    tenant_subject_prefix,
)

INJECTION_ATTEMPTS = [
    pytest.param("", id="empty"),
    pytest.param("acme.>", id="dot-and-full-wildcard"),
    pytest.param("acme.evil", id="dot"),
    pytest.param("*", id="star"),
    pytest.param(">", id="full-wildcard"),
    pytest.param("ac*me", id="embedded-star"),
    pytest.param("acme>", id="embedded-gt"),
    pytest.param("ac me", id="space"),
    pytest.param("acme\t", id="tab"),
    pytest.param("acme\n", id="trailing-newline"),
    pytest.param("acme\r\nPUB x 1", id="crlf-protocol-injection"),
    pytest.param("Acme", id="uppercase"),
    pytest.param("\u0430cme", id="cyrillic-a"),
    pytest.param("\uff41cme", id="fullwidth-a"),
    pytest.param("acm\u0435", id="cyrillic-e"),
    pytest.param("-acme", id="leading-dash"),
    pytest.param("_acme", id="leading-underscore"),
    pytest.param("a" * 64, id="too-long"),
    pytest.param("acme\x00", id="nul"),
    pytest.param(None, id="none"),
    pytest.param(7, id="int"),
]


@pytest.mark.parametrize("kind", list(EventKind))
def test_tenant_event_subject_round_trips(kind: EventKind) -> None:
    subject = tenant_event_subject("acme", kind, "job-1")
    assert subject == f"hz.t.acme.events.{kind.value}.job-1"
    parsed = parse_tenant_event_subject(subject)
    assert parsed == TenantEventSubject(tenant="acme", kind=kind, job="job-1")
    assert str(parsed) == subject


def test_kind_may_be_given_as_its_string() -> None:
    assert tenant_event_subject("acme", "failure", "j_2") == "hz.t.acme.events.failure.j_2"


def test_job_directives_subject_round_trips() -> None:
    subject = job_directives_subject("acme", "train-7")
    assert subject == "hz.t.acme.jobs.train-7.directives"
    parsed = parse_job_directives_subject(subject)
    assert parsed == JobDirectivesSubject(tenant="acme", job="train-7")
    assert str(parsed) == subject


@pytest.mark.parametrize(
    ("kind", "job", "expected"),
    [
        (None, None, "hz.t.acme.events.*.*"),
        (EventKind.FAILURE, None, "hz.t.acme.events.failure.*"),
        (None, "job-1", "hz.t.acme.events.*.job-1"),
        ("carbon", "job-1", "hz.t.acme.events.carbon.job-1"),
    ],
)
def test_events_filter_uses_wildcards_only_for_any(kind: str | None, job: str | None, expected: str) -> None:
    assert tenant_events_filter("acme", kind=kind, job=job) == expected


def test_slice_and_stream_filter() -> None:
    assert tenant_slice("acme") == "hz.t.acme.>"
    assert ALL_TENANT_EVENTS == "hz.t.*.events.*.*"


def test_subject_prefix_is_the_slice_without_its_wildcard() -> None:
    assert tenant_subject_prefix("acme") == "hz.t.acme."
    assert tenant_slice("acme") == tenant_subject_prefix("acme") + REST


def test_provider_subjects() -> None:
    assert provider_subject("hosts", "gpu-node-17", "commands") == "hz.p.hosts.gpu-node-17.commands"
    assert provider_filter("telemetry", ANY, "gpu") == "hz.p.telemetry.*.gpu"
    assert provider_filter("telemetry", REST) == "hz.p.telemetry.>"


@pytest.mark.parametrize("bad", INJECTION_ATTEMPTS)
def test_builders_refuse_bad_tenant(bad: object) -> None:
    with pytest.raises(InvalidIdError):
        tenant_event_subject(bad, EventKind.FAILURE, "job-1")  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        tenant_events_filter(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        job_directives_subject(bad, "job-1")  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        tenant_slice(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        tenant_subject_prefix(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", INJECTION_ATTEMPTS)
def test_builders_refuse_bad_job(bad: object) -> None:
    with pytest.raises(InvalidIdError):
        tenant_event_subject("acme", EventKind.FAILURE, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        job_directives_subject("acme", bad)  # type: ignore[arg-type]
    if bad is not None:  # None is how a filter says "any job"
        with pytest.raises(InvalidIdError):
            tenant_events_filter("acme", job=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", INJECTION_ATTEMPTS)
def test_provider_subject_refuses_bad_tokens(bad: object) -> None:
    with pytest.raises(InvalidIdError):
        provider_subject("hosts", bad, "commands")  # type: ignore[arg-type]


def test_provider_filter_allows_rest_only_last() -> None:
    with pytest.raises(InvalidIdError):
        provider_filter(REST, "commands")
    with pytest.raises(InvalidIdError):
        provider_filter("hosts", "gpu.*")
    with pytest.raises(ValueError):
        provider_subject()


@pytest.mark.parametrize("bad", ["failure.>", "*", ">", "Failure", "failures", "f\u0430ilure", "", None])
def test_builders_refuse_unknown_kinds(bad: object) -> None:
    with pytest.raises(UnknownEventKindError):
        tenant_event_subject("acme", bad, "job-1")  # type: ignore[arg-type]
    if bad is not None:
        with pytest.raises(UnknownEventKindError):
            tenant_events_filter("acme", kind=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "subject",
    [
        "",
        "hz.t.acme.events.failure",
        "hz.t.acme.events.failure.job-1.extra",
        "hz.t.acme.events.failure.*",
        "hz.t.*.events.failure.job-1",
        "hz.t.acme.events.>",
        "hz.t.acme.events.failur.job-1",
        "hz.p.acme.events.failure.job-1",
        "hz.t.acme.jobs.failure.job-1",
        "hz.t.Acme.events.failure.job-1",
        "hz.t.\u0430cme.events.failure.job-1",
        "hz.t.acme.events.failure.job-1\n",
        "hz.t..events.failure.job-1",
        "HZ.T.acme.events.failure.job-1",
        "hz.t.acme.events.failure.j ob",
    ],
)
def test_parse_tenant_event_subject_refuses_malformed(subject: str) -> None:
    with pytest.raises(InvalidSubjectError):
        parse_tenant_event_subject(subject)


@pytest.mark.parametrize(
    "subject",
    [
        "hz.t.acme.jobs.job-1",
        "hz.t.acme.jobs.*.directives",
        "hz.t.acme.jobs.job-1.commands",
        "hz.t.acme.events.job-1.directives",
        "hz.t.acme.jobs.Job.directives",
    ],
)
def test_parse_job_directives_subject_refuses_malformed(subject: str) -> None:
    with pytest.raises(InvalidSubjectError):
        parse_job_directives_subject(subject)


def test_parse_refuses_non_strings() -> None:
    with pytest.raises(InvalidSubjectError):
        parse_tenant_event_subject(b"hz.t.acme.events.failure.job-1")  # type: ignore[arg-type]
