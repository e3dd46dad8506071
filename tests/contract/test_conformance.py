"""`harmonaize conformance`, fast tier: the pure checks on hand-built messages, the probes' verdicts, the report, and
the command's refusals of bad input (exit 2, one line naming the problem).

A valid event passes every group; each violation fails with a reason that names it: a missing id, specversion 0.3, a
bad attribute name, a time that is not RFC 3339, a payload that breaks its schema, a subject of another kind or job,
an unknown type, an id seen twice. The real tier (tests/cloud/test_conformance_cloud.py) runs the command against a
local cloud and a deliberately broken feed.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from harmonaize.asyncapi import EXAMPLE_DATA
from harmonaize_cli.conformance.binding import CLOUDEVENTS_JSON, ContentMode, Received, decode
from harmonaize_cli.conformance.checks import DuplicateTracker, MessageResult, check_message
from harmonaize_cli.conformance.command import conformance_command, url_problem
from harmonaize_cli.conformance.envelope import check_envelope, is_rfc3339
from harmonaize_cli.conformance.findings import Group, Severity
from harmonaize_cli.conformance.interface import Interface, load_interface
from harmonaize_cli.conformance.probes import (
    Action,
    NatsProbe,
    ProbeResult,
    nats_probes,
    rest_outcome,
    rest_probes,
    violation_seen,
)
from harmonaize_cli.conformance.report import Report

ROOT = Path(__file__).resolve().parents[2]
TENANT, JOB = "acme", "train-7"
EVENT_ID = "0195946c-6a05-7b3e-9f1d-2c4e6a8b0d12"
FAILURE_SUBJECT = f"hz.t.{TENANT}.events.failure.{JOB}"


@pytest.fixture(scope="module")
def interface() -> Interface:
    return load_interface()


def failure_event(**changes: Any) -> dict[str, Any]:
    """A failure event as a provider publishes it (structured mode), with `changes` applied (None removes)."""
    event: dict[str, Any] = {
        "specversion": "1.0",
        "id": EVENT_ID,
        "source": "/hz/provider/agent/h-1a2b3c4d",
        "type": "io.harmonaize.failure.v1",
        "subject": JOB,
        "time": "2025-03-14T02:00:05.123456Z",
        "datacontenttype": "application/json",
        "data": dict(EXAMPLE_DATA["io.harmonaize.failure.v1"][1]),
    }
    for name, value in changes.items():
        if value is None:
            event.pop(name, None)
        else:
            event[name] = value
    return event


def message(
    event: Mapping[str, Any], *, subject: str = FAILURE_SUBJECT, headers: Mapping[str, str] | None = None
) -> Received:
    default = {"Nats-Msg-Id": str(event.get("id", "")), "Content-Type": CLOUDEVENTS_JSON}
    return Received(subject=subject, body=json.dumps(event).encode(), headers=default if headers is None else headers)


def check(received: Received, interface: Interface, duplicates: DuplicateTracker | None = None) -> MessageResult:
    return check_message(received, tenant=TENANT, interface=interface, duplicates=duplicates or DuplicateTracker())


def failures(result: MessageResult, group: Group | None = None) -> list[str]:
    return [f.reason for f in result.findings if f.severity == Severity.FAILURE and group in (None, f.group)]


# --- the checks ---------------------------------------------------------------------------------------------------


def test_a_valid_event_passes_every_group(interface: Interface) -> None:
    result = check(message(failure_event()), interface)
    assert result.findings == (), result.findings
    assert result.checked == {Group.BINDING, Group.ENVELOPE, Group.SUBJECT, Group.SCHEMA, Group.DUPLICATES}
    assert (result.event_id, result.event_type) == (EVENT_ID, "io.harmonaize.failure.v1")


def test_every_published_example_passes_on_its_channel(interface: Interface) -> None:
    """The document's own examples, sent where the document says: the checks and the document agree."""
    for message_spec in interface.document["components"]["messages"].values():
        example = message_spec["examples"][0]
        kind = message_spec["name"].split(".")[2]
        payload = example["payload"]
        received = Received(subject=f"hz.t.{TENANT}.events.{kind}.{payload['subject']}", body=json.dumps(payload)
                            .encode(), headers={**example["headers"], "Content-Type": CLOUDEVENTS_JSON})
        assert check(received, interface).findings == (), message_spec["name"]


def test_a_missing_id_fails_naming_id(interface: Interface) -> None:
    result = check(message(failure_event(id=None), headers={"Content-Type": CLOUDEVENTS_JSON}), interface)
    assert any("'id' is missing" in reason for reason in failures(result, Group.ENVELOPE)), result.findings
    assert result.event_id is None and Group.DUPLICATES not in result.checked


def test_specversion_0_3_fails_naming_specversion(interface: Interface) -> None:
    result = check(message(failure_event(specversion="0.3")), interface)
    assert any("specversion '0.3' is not '1.0'" in reason for reason in failures(result, Group.ENVELOPE))


def test_a_bad_attribute_name_fails_and_a_long_one_is_a_spec_warning(interface: Interface) -> None:
    result = check(message(failure_event(**{"Trace-Id": "x"})), interface)
    assert any("attribute name 'Trace-Id'" in reason for reason in failures(result, Group.ENVELOPE))
    long_name = "averyveryverylongname"  # 21 characters: CloudEvents says SHOULD NOT, the interface says no
    spec_only = check_envelope(failure_event(**{long_name: "x"}))
    assert [(f.severity, long_name in f.reason) for f in spec_only] == [(Severity.WARNING, True)]
    assert any("published envelope schema" in reason
               for reason in failures(check(message(failure_event(**{long_name: "x"})), interface)))


@pytest.mark.parametrize("value", ["2025-03-14 02:00:05Z", "2025-02-30T00:00:00Z", "yesterday", "2025-03-14T25:00:00Z"])
def test_a_time_that_is_not_rfc3339_fails_naming_time(interface: Interface, value: str) -> None:
    result = check(message(failure_event(time=value)), interface)
    assert any(reason.startswith(f"time {value!r} is not an RFC 3339") for reason in failures(result))


def test_rfc3339_accepts_offsets_fractions_and_leap_seconds() -> None:
    for value in ("2025-03-14T02:00:05Z", "2025-03-14t02:00:05.123456789+05:30", "2016-12-31T23:59:60Z"):
        assert is_rfc3339(value), value


def test_a_payload_that_breaks_its_schema_fails_naming_the_field(interface: Interface) -> None:
    data = {**failure_event()["data"], "confidence": 5}
    del data["detected_at"]
    result = check(message(failure_event(data=data)), interface)
    reasons = failures(result, Group.SCHEMA)
    assert any("data.confidence" in reason for reason in reasons), reasons
    assert any("detected_at" in reason for reason in reasons), reasons
    assert not failures(result, Group.ENVELOPE), "a bad payload is reported once, by the schema group"


def test_a_subject_of_another_kind_or_job_fails(interface: Interface) -> None:
    wrong_kind = check(message(failure_event(), subject=f"hz.t.{TENANT}.events.carbon.{JOB}"), interface)
    assert any("type 'io.harmonaize.failure.v1' is not published on" in reason
               for reason in failures(wrong_kind, Group.SUBJECT)), wrong_kind.findings
    wrong_job = check(message(failure_event(), subject=f"hz.t.{TENANT}.events.failure.other-job"), interface)
    assert any("{job} token 'other-job'" in reason for reason in failures(wrong_job, Group.SUBJECT))
    nowhere = check(message(failure_event(), subject=f"hz.t.{TENANT}.jobs.{JOB}.directives"), interface)
    assert any("is no channel address" in reason for reason in failures(nowhere, Group.SUBJECT))
    other_tenant = check(message(failure_event(), subject=f"hz.t.someone.events.failure.{JOB}"), interface)
    assert failures(other_tenant, Group.SUBJECT), "a subject of another tenant is no address of this tenant's"


def test_an_unknown_type_fails(interface: Interface) -> None:
    result = check(message(failure_event(type="io.harmonaize.weather.v1")), interface)
    assert any("unknown type 'io.harmonaize.weather.v1'" in reason for reason in failures(result, Group.SCHEMA))


def test_a_duplicate_id_is_counted_and_a_different_event_under_it_fails(interface: Interface) -> None:
    duplicates = DuplicateTracker()
    assert check(message(failure_event()), interface, duplicates).findings == ()
    resent = check(message(failure_event()), interface, duplicates)
    assert [(f.group, f.severity) for f in resent.findings] == [(Group.DUPLICATES, Severity.WARNING)]
    changed = check(message(failure_event(time="2025-03-14T02:00:06Z")), interface, duplicates)
    assert any(f"duplicate id {EVENT_ID!r}" in reason for reason in failures(changed, Group.DUPLICATES))
    assert duplicates.duplicates == 2
    strict = DuplicateTracker(strict=True)
    check(message(failure_event()), interface, strict)
    assert any("duplicate id" in reason for reason in failures(check(message(failure_event()), interface, strict)))


# --- the NATS binding ---------------------------------------------------------------------------------------------


def test_without_content_type_the_event_is_read_as_structured_but_breaks_the_published_headers(
    interface: Interface,
) -> None:
    """The binding's 1.0.2 release allows it (a warning); our interface promises the header (a failure)."""
    result = check(message(failure_event(), headers={"Nats-Msg-Id": EVENT_ID}), interface)
    assert [(f.group, f.severity) for f in result.findings] == [
        (Group.BINDING, Severity.WARNING), (Group.BINDING, Severity.FAILURE)]
    assert all("Content-Type" in finding.reason for finding in result.findings)


def test_binary_mode_is_decoded_and_fails_the_structured_interface(interface: Interface) -> None:
    event = failure_event()
    headers = {f"ce-{name}": str(value) for name, value in event.items() if name != "data"}
    headers["ce-source"] = "/hz/provider/agent/h-1a2b3c4d".replace("/", "%2F")  # percent-decoded on the way in
    headers["Nats-Msg-Id"] = EVENT_ID
    received = Received(FAILURE_SUBJECT, json.dumps(event["data"]).encode(), headers)
    decoded = decode(received)
    assert decoded.mode is ContentMode.BINARY and decoded.event == event
    result = check(received, interface)
    assert [reason for reason in failures(result) if "binary content mode" in reason], result.findings
    assert [reason for reason in failures(result) if '"Content-Type" is a required property' in reason]
    assert len(failures(result)) == 2, result.findings


def test_binding_header_problems_fail(interface: Interface) -> None:
    no_msg_id = check(message(failure_event(), headers={"Content-Type": CLOUDEVENTS_JSON}), interface)
    assert any("Nats-Msg-Id" in reason for reason in failures(no_msg_id, Group.BINDING))
    other_id = check(message(failure_event(), headers={"Content-Type": CLOUDEVENTS_JSON, "Nats-Msg-Id": "x"}),
                     interface)
    assert any("is not the event id" in reason for reason in failures(other_id, Group.BINDING))
    not_json = check(Received(FAILURE_SUBJECT, b"{nope", {"Content-Type": CLOUDEVENTS_JSON}), interface)
    assert not_json.checked == {Group.BINDING} and "not JSON" in failures(not_json)[0]
    batch = check(Received(FAILURE_SUBJECT, b"[]", {"Content-Type": "application/cloudevents-batch+json"}), interface)
    assert "batch" in failures(batch)[0]
    nan = check(Received(FAILURE_SUBJECT, b'{"specversion": NaN}', {"Content-Type": CLOUDEVENTS_JSON}), interface)
    assert "NaN is not JSON" in failures(nan)[0]


# --- the interface ------------------------------------------------------------------------------------------------


def test_the_committed_documents_are_the_built_in_interface(interface: Interface) -> None:
    published = load_interface(ROOT / "docs" / "asyncapi")
    assert published.types == interface.types and len(published.channels) == len(interface.channels)
    assert check(message(failure_event()), published).findings == ()


def test_channel_addresses_match_one_token_per_parameter(interface: Interface) -> None:
    failure = next(channel for channel in interface.channels if channel.name == "failure")
    assert failure.match(FAILURE_SUBJECT, tenant=TENANT) == {"tenant": TENANT, "job": JOB}
    for subject in (f"hz.t.{TENANT}.events.failure.a.b", f"hz.t.{TENANT}.events.failure.*", "hz.t.x.events.failure.j"):
        assert failure.match(subject, tenant=TENANT) is None, subject
    assert failure.locations == {"job": "/subject"}


# --- probes and report --------------------------------------------------------------------------------------------


def test_probes_reach_only_outside_the_slice_or_forbidden_apis() -> None:
    probes = nats_probes(TENANT, other_tenant="other")
    subjects = {probe.subject for probe in probes}
    assert {"hz.t.other.>", "hz.p.>", ">", "$KV.hz_desired.>", "$JS.hz.API.STREAM.INFO.HZ_T_other",
            "$JS.API.STREAM.INFO.HZ_T_other", "$JS.hz.API.CONSUMER.CREATE.HZ_T_acme"} <= subjects
    own = [p for p in probes if p.subject.startswith(f"hz.t.{TENANT}.")]
    assert [p.action for p in own] == [Action.PUBLISH], "the only probe inside the slice is a forged publish"
    paths = [probe.path for probe in rest_probes(other_tenant="other", other_job="their-job")]
    assert "/v1/tenants" in paths and "/v1/jobs/their-job/status" in paths


def test_a_violation_is_matched_by_action_and_subject_case_insensitively() -> None:
    errors = ['nats: permissions violation for subscription to "$kv.hz_desired.>"']
    assert violation_seen(errors, NatsProbe("kv", Action.SUBSCRIBE, "$KV.hz_desired.>"))
    assert not violation_seen(errors, NatsProbe("kv", Action.PUBLISH, "$KV.hz_desired.>"))
    assert not violation_seen(errors, NatsProbe("p", Action.SUBSCRIBE, "hz.p.>"))


def test_rest_refusals_are_403_or_404_and_anything_else_fails() -> None:
    assert rest_outcome(403)[0] and rest_outcome(404)[0]
    assert not rest_outcome(200)[0] and "answered 200" in rest_outcome(200)[1]
    assert not rest_outcome(422)[0] and not rest_outcome(500)[0]


def test_the_report_lists_each_failure_with_its_event_id_and_each_failed_probe(interface: Interface) -> None:
    report = Report(tenant=TENANT, subject=f"hz.t.{TENANT}.>", interface="built-in", expected_events=3)
    report.add_message(check(message(failure_event()), interface))
    report.add_message(check(message(failure_event(id="e-2", specversion="0.3")), interface))
    report.add_probes([ProbeResult("provider-internal subjects", "subscribe hz.p.>", False, "accepted"),
                       ProbeResult("list tenants (admin)", "GET /v1/tenants", True, "refused (403)")])
    report.finish(seconds=1.0, duplicates=0)
    text = report.render()
    assert not report.passed
    assert "envelope    FAIL  2 checked, 1 failed" in text and "schema      PASS  2 checked, 0 failed" in text
    assert "isolation   FAIL  2 probes, 1 refused" in text
    assert "id e-2 on hz.t.acme.events.failure.train-7: specversion '0.3'" in text
    assert "provider-internal subjects (subscribe hz.p.>): accepted" in text
    assert "only 2 of the 3 events asked for" in text
    data = report.to_json()
    assert data["passed"] is False and data["feed"]["events"] == 2
    assert data["groups"]["isolation"] == {"passed": False, "checked": 2, "failed": 1, "warned": 0}
    assert {item["event_id"] for item in data["failures"]} == {"e-2"}
    json.dumps(data)


# --- the command's bad input --------------------------------------------------------------------------------------


def _invoke(monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str], *args: str) -> tuple[int, str]:
    for key in [key for key in os.environ if key.startswith("HZ_")]:
        monkeypatch.delenv(key)
    app = typer.Typer(add_completion=False)
    app.command()(conformance_command)
    result = CliRunner().invoke(app, list(args), env={**env, "COLUMNS": "200", "NO_COLOR": "1"})
    return result.exit_code, result.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GOOD_SEED = "SUAGX4PN6B5SNURFLYPKQ4OBK23B6VQEPUNDYIUSO23Z4S3ZJ4JZJLFFNI"


def _env(**changes: str) -> dict[str, str]:
    port = _closed_port()
    env = {"HZ_TENANT": TENANT, "HZ_TENANT_TOKEN": "hzt_x", "HZ_TENANT_NATS_SEED": GOOD_SEED,
           "HZ_NATS_URL": f"nats://127.0.0.1:{port}", "HZ_API_URL": f"http://127.0.0.1:{port}"}
    return {**env, **changes}


@pytest.mark.parametrize(("env", "args", "needle"), [
    ({}, (), "HZ_TENANT, HZ_TENANT_TOKEN, HZ_TENANT_NATS_SEED, HZ_NATS_URL, HZ_API_URL are not set"),
    ({"HZ_TENANT_NATS_SEED": ""}, (), "HZ_TENANT_NATS_SEED is not set"),
    ({"HZ_NATS_URL": "http://127.0.0.1:4222"}, (), "HZ_NATS_URL: 'http://127.0.0.1:4222' is not a nats"),
    ({"HZ_API_URL": "localhost:8080"}, (), "HZ_API_URL: 'localhost:8080' is not a http/https URL"),
    ({"HZ_TENANT_NATS_SEED": "SUNOTASEED"}, (), "HZ_TENANT_NATS_SEED is not a NATS user nkey seed"),
    (None, ("--job", "Bad.Job"), "--job"),
    (None, ("--other-tenant", TENANT), "--other-tenant"),
    (None, ("--spec", "/nonexistent-conformance-spec"), "--spec"),
    (None, (), "cannot reach the API"),
])
def test_bad_input_exits_2_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None, args: tuple[str, ...], needle: str
) -> None:
    code, output = _invoke(monkeypatch, _env() if env is None else (_env(**env) if env else {}), *args,
                           "--duration", "1")
    assert code == 2, output
    assert output.strip().count("\n") == 0 and needle in output, output


def test_url_problems_name_the_url() -> None:
    assert url_problem("nats://a:4222,nats://b:4222", ("nats",)) is None
    assert url_problem("nats://a:99999", ("nats",)) is not None
    assert url_problem("nats://", ("nats",)) is not None
