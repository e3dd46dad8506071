"""Isolation probes: with a tenant's credentials, try what they must not allow, and expect each try refused.

On NATS a refusal is a permissions violation, which the server reports asynchronously (`-ERR` through the client's
error callback) and which names the subject: so each probe is sent, and then the probes wait together, up to a
deadline, for the violation naming their subject. A probe is refused only if its violation came and nothing came
back (a reply to a request, a message on a subscription); silence is not a refusal, since an allowed publish with no
subscriber is silent too. Over REST a refusal is 403 or 404 (401 too, though a valid token should never see it);
anything else fails, a 2xx loudest.

Every probe is harmless if the isolation it tests holds, and as harmless as possible if it does not: REST probes are
GETs only, requests carry empty bodies (a JetStream API call with no config creates nothing), publishes carry a
marker header (`Hz-Conformance-Probe`) that says what they are, and a subscription that was wrongly allowed only
counts what reaches it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker_config.render import TENANT_JS_PREFIX, tenant_stream_name
from harmonaize.desired_state import DESIRED_STATE_BUCKET
from harmonaize.subjects import (
    ALL_TENANT_EVENTS,
    REST,
    provider_filter,
    provider_subject,
    tenant_event_subject,
    tenant_slice,
)

__all__ = [
    "PROBE_HEADER",
    "Action",
    "NatsProbe",
    "ProbeResult",
    "RestProbe",
    "nats_probes",
    "rest_outcome",
    "rest_probes",
    "run_nats_probes",
    "run_rest_probes",
    "violation_seen",
]

PROBE_HEADER: Final = "Hz-Conformance-Probe"
PROVIDER_JS_PREFIX: Final = "$JS.API"
PROBE_JOB: Final = "conformance-probe"
REFUSED_STATUSES: Final = frozenset({401, 403, 404})


class Action(StrEnum):
    SUBSCRIBE = "subscribe"
    PUBLISH = "publish"
    REQUEST = "request"


@dataclass(frozen=True, slots=True)
class NatsProbe:
    name: str
    action: Action
    subject: str

    @property
    def target(self) -> str:
        return f"{self.action} {self.subject}"


@dataclass(frozen=True, slots=True)
class RestProbe:
    name: str
    path: str

    @property
    def target(self) -> str:
        return f"GET {self.path}"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    name: str
    target: str
    refused: bool
    detail: str


def nats_probes(tenant: str, *, other_tenant: str) -> list[NatsProbe]:
    """What a tenant's NATS user must not do: reach another tenant, the provider's subjects, streams or KV."""
    other, own = tenant_stream_name(other_tenant), tenant_stream_name(tenant)
    kv_stream, kv_subjects = f"KV_{DESIRED_STATE_BUCKET}", f"$KV.{DESIRED_STATE_BUCKET}.>"
    js = TENANT_JS_PREFIX
    sub, pub, req = Action.SUBSCRIBE, Action.PUBLISH, Action.REQUEST
    return [
        NatsProbe("another tenant's slice", sub, tenant_slice(other_tenant)),
        NatsProbe("every tenant's events", sub, ALL_TENANT_EVENTS),
        NatsProbe("provider-internal subjects", sub, provider_filter(REST)),
        NatsProbe("every subject", sub, ">"),
        NatsProbe("the desired-state KV bucket", sub, kv_subjects),
        NatsProbe("forge an event into another tenant's feed", pub,
                  tenant_event_subject(other_tenant, "failure", PROBE_JOB)),
        NatsProbe("forge an event into its own feed", pub, tenant_event_subject(tenant, "failure", PROBE_JOB)),
        NatsProbe("publish provider-internal", pub, provider_subject("conformance", "probe")),
        NatsProbe("ack another tenant's deliveries", pub, f"$JS.ACK.{other}.{PROBE_JOB}.1.1.1.0.0"),
        NatsProbe("another tenant's stream, provider API", req, f"{PROVIDER_JS_PREFIX}.STREAM.INFO.{other}"),
        NatsProbe("another tenant's stream, tenant API", req, f"{js}.STREAM.INFO.{other}"),
        NatsProbe("pull another tenant's events", req, f"{js}.CONSUMER.MSG.NEXT.{other}.{PROBE_JOB}"),
        NatsProbe("read another tenant's stream directly", req, f"{PROVIDER_JS_PREFIX}.STREAM.MSG.GET.{other}"),
        NatsProbe("list the provider's streams", req, f"{PROVIDER_JS_PREFIX}.STREAM.NAMES"),
        NatsProbe("list streams, tenant API", req, f"{js}.STREAM.NAMES"),
        NatsProbe("desired-state bucket info", req, f"{PROVIDER_JS_PREFIX}.STREAM.INFO.{kv_stream}"),
        NatsProbe("read desired state", req, f"{PROVIDER_JS_PREFIX}.DIRECT.GET.{kv_stream}"),
        NatsProbe("read desired state, tenant API", req, f"{js}.DIRECT.GET.{kv_stream}"),
        NatsProbe("create a consumer on its own stream (a push consumer could deliver anywhere)", req,
                  f"{js}.CONSUMER.CREATE.{own}"),
    ]


def rest_probes(*, other_tenant: str, other_job: str) -> list[RestProbe]:
    """What a tenant's API token must not read: admin routes, another tenant, another tenant's job."""
    job = f"/v1/jobs/{other_job}"
    return [
        RestProbe("list tenants (admin)", "/v1/tenants"),
        RestProbe("read another tenant (admin)", f"/v1/tenants/{other_tenant}"),
        RestProbe("list hosts (admin)", "/v1/hosts"),
        RestProbe("another tenant's allocations (admin)", f"/v1/allocations?tenant_id={other_tenant}"),
        RestProbe("provider metrics (admin)", "/v1/metrics"),
        RestProbe("another tenant's job", job),
        RestProbe("another tenant's job status", f"{job}/status"),
        RestProbe("another tenant's job timeline", f"{job}/timeline"),
        RestProbe("another tenant's job directives", f"{job}/directives"),
        RestProbe("another tenant's job allocations", f"{job}/allocations"),
    ]


def violation_seen(errors: Sequence[str], probe: NatsProbe) -> bool:
    """Whether the broker reported a permissions violation for this probe's subject (nats-py lowercases it)."""
    verb = "subscription" if probe.action is Action.SUBSCRIBE else "publish"
    needle = f'permissions violation for {verb} to "{probe.subject.lower()}"'
    return any(needle in error.lower() for error in errors)


def rest_outcome(status: int) -> tuple[bool, str]:
    """(refused, detail) for a REST probe's status code."""
    if status in REFUSED_STATUSES:
        return True, f"refused ({status})"
    if 200 <= status < 300:
        return False, f"answered {status}: the route served a tenant token"
    return False, f"not refused: {status} (expected 403 or 404)"


async def run_nats_probes(
    nc: Client, errors: Sequence[str], probes: Sequence[NatsProbe], *, timeout: float, nonce: str
) -> list[ProbeResult]:
    """Send every probe on `nc` (whose error callback appends to `errors`), then wait up to `timeout` for each to be
    decided: its violation, or something coming back."""
    inbox = nc.new_inbox()
    came_back: dict[int, str] = {}

    async def on_reply(msg: Msg) -> None:
        index = int(msg.subject.rsplit(".", 1)[1])
        came_back.setdefault(index, f"answered: {_describe(msg)}")

    await nc.subscribe(f"{inbox}.*", cb=on_reply)
    headers = {PROBE_HEADER: nonce}
    for index, probe in enumerate(probes):
        if probe.action is Action.SUBSCRIBE:
            await nc.subscribe(probe.subject, cb=_on_message(index, came_back))
        elif probe.action is Action.PUBLISH:
            await nc.publish(probe.subject, b"", headers=headers)
        else:
            await nc.publish(probe.subject, b"", reply=f"{inbox}.{index}", headers=headers)
    deadline = time.monotonic() + timeout
    try:
        await nc.flush(timeout=max(1, int(timeout)))
    except (TimeoutError, OSError) as exc:  # the verdicts below still say what came back; a lost flush is noted
        came_back.setdefault(-1, f"flush failed: {exc!r}")

    def decided(index: int, probe: NatsProbe) -> bool:
        return index in came_back or violation_seen(errors, probe)

    while time.monotonic() < deadline and not all(decided(i, probe) for i, probe in enumerate(probes)):
        await asyncio.sleep(0.02)
    results = []
    for index, probe in enumerate(probes):
        if index in came_back:
            results.append(ProbeResult(probe.name, probe.target, False, came_back[index]))
        elif violation_seen(errors, probe):
            results.append(ProbeResult(probe.name, probe.target, True, "refused (permissions violation)"))
        else:
            results.append(ProbeResult(probe.name, probe.target, False,
                                       f"accepted: no permissions violation within {timeout:g} s"))
    return results


async def run_rest_probes(client: httpx.AsyncClient, probes: Sequence[RestProbe]) -> list[ProbeResult]:
    """Every REST probe with the tenant's token (the client's), one after the other."""
    results = []
    for probe in probes:
        try:
            reply = await client.get(probe.path)
        except httpx.HTTPError as exc:
            results.append(ProbeResult(probe.name, probe.target, False, f"no answer: {exc!r}"))
            continue
        refused, detail = rest_outcome(reply.status_code)
        results.append(ProbeResult(probe.name, probe.target, refused, detail))
    return results


def _on_message(index: int, came_back: dict[int, str]) -> Callable[[Msg], Awaitable[None]]:
    async def on_message(msg: Msg) -> None:
        came_back.setdefault(index, f"received a message on {msg.subject}")

    return on_message


def _describe(msg: Msg) -> str:
    status = (msg.headers or {}).get("Status")
    if status:
        return f"status {status} {(msg.headers or {}).get('Description', '')}".strip()
    return msg.data[:120].decode("utf-8", "replace") or "(empty)"
