"""A fake of the provider's negotiation REST API: an httpx transport that keeps jobs and negotiations in memory.

It follows the REST contract the real API implements (`GET /v1/jobs/{id}`, `PUT /v1/event-consumers/{name}`,
`POST /v1/negotiations` with `Idempotency-Key`, actions on `/v1/negotiations/{id}/{action}`, JSON errors
`{"reason", "errors"}`), so `ProviderApi` runs against it unchanged. What the provider answers is up to the test:

* scripted answers (`answer(offer(workers=3), decline("full"))`) are used first, one per request or counter;
* then `policy`, a function of the negotiation as it stands, if the test set one;
* otherwise a deliberately simple default: a job gets at most `capacity[job]` workers; a scale request is offered
  `min(desired, capacity)` if that lies in the tenant's range, and declined otherwise; a maintenance approval is
  offered while the job has workers (`approve now`), as the real provider does, and declined otherwise.

Faults are scripted per request (`fail_next`, `slow_next`), including the nasty one: the change is applied and *then*
the reply is lost (`lose_reply=True`), which is what the SDK's idempotency keys exist for. Every request and every
round is kept, so a test asserts on what the controller actually asked.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import OfferOption
from harmonaize.ranges import IntRange
from harmonaize.rest import GradientCompression, JobPublic, NegotiationPublic

__all__ = ["Answer", "FakeProvider", "Policy", "ScriptedFault", "decline", "offer"]


@dataclass(frozen=True)
class Answer:
    """The provider's answer to one request or counter: an offer of `options`, or (no options) a decline."""

    options: tuple[OfferOption, ...] = ()
    note: str | None = None

    @property
    def declines(self) -> bool:
        return not self.options


Policy = Callable[[NegotiationPublic], Answer]
"""Decides the answer from the negotiation as it stands (its kind, job, round and current terms)."""


def offer(*options: OfferOption | Mapping[str, Any], **option: Any) -> Answer:
    """An offer: `offer(workers=3)` for one option, `offer({"workers": 3}, {"workers": 2})` for several."""
    chosen: list[OfferOption | Mapping[str, Any]] = [*options, option] if option else list(options)
    if not chosen:
        raise ValueError("offer() needs at least one option")
    return Answer(options=tuple(o if isinstance(o, OfferOption) else OfferOption.model_validate(o) for o in chosen))


def decline(note: str = "no capacity inside the requested range") -> Answer:
    """A decline: the SDK raises `Declined` carrying `note`."""
    return Answer(note=note)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class ScriptedFault:
    """One request that misbehaves: fails with `status`, or (status None) is answered normally after `delay`."""

    status: int | None = 503
    lose_reply: bool = False  # apply the request, then answer with `status` (or drop the connection if 0)
    path_contains: str = ""
    delay: float = 0.0


@dataclass
class FakeProvider:
    """Jobs, negotiations and their history; `transport` is what `ProviderApi(transport=...)` takes."""

    tenant: str = "acme"
    token: str = "tenant-token"
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    negotiations: dict[str, dict[str, Any]] = field(default_factory=dict)
    idempotency: dict[str, tuple[str, str]] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    faults: list[ScriptedFault] = field(default_factory=list)
    consumers: dict[str, dict[str, Any]] = field(default_factory=dict)
    flaky: float = 0.0
    """Probability that any request fails with 503 before reaching the provider's logic."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    policy: Policy | None = None
    """How to answer once the scripted answers are used up (None: the capacity policy described above)."""
    answers: list[Answer] = field(default_factory=list)
    opened: list[dict[str, Any]] = field(default_factory=list)
    """Each negotiation as it stood right after the provider's first answer, in the order they were opened."""
    _taken: int = field(default=0, init=False, repr=False)

    # -- setting the scene -------------------------------------------------------------------------------------------

    def add_job(self, job_id: str, *, min_workers: int = 1, max_workers: int = 4, desired: int = 2,
                plan: str = "ddp", capacity: int | None = None) -> None:
        """A job of this tenant, running at `desired` workers; the default policy grants up to `capacity`."""
        self.jobs[job_id] = JobPublic(
            id=job_id, name=job_id, min_workers=min_workers, max_workers=max_workers, gpus_per_worker=1,
            parallel_plan=ParallelPlan(plan), desired_workers=desired,
            checkpoint_interval_steps=IntRange(min=100, max=1000), gradient_compression=GradientCompression(),
            batch_size=None, gradient_accumulation=IntRange(min=1, max=1), global_batch=None,
            entrypoint=[], placement_epoch=0, created_at=datetime.now(UTC),
        ).model_dump(mode="json")
        self.capacity[job_id] = max_workers if capacity is None else capacity

    def answer(self, *answers: Answer) -> None:
        """Queue answers for the next requests and counters, in order (then `policy` or the default takes over)."""
        self.answers.extend(answers)

    def fail_next(
        self, count: int = 1, *, status: int = 503, lose_reply: bool = False, path_contains: str = ""
    ) -> None:
        """The next `count` requests (whose path contains `path_contains`) fail with `status` (0: no reply at all)."""
        self.faults.extend(ScriptedFault(status, lose_reply, path_contains) for _ in range(count))

    def slow_next(self, delay: float, count: int = 1, *, path_contains: str = "") -> None:
        """The next `count` requests are answered normally, but only after `delay` seconds."""
        self.faults.extend(ScriptedFault(None, False, path_contains, delay) for _ in range(count))

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    # -- what the test reads -----------------------------------------------------------------------------------------

    def posts(self, path: str = "/v1/negotiations") -> list[httpx.Request]:
        """The POST requests sent to `path` (resends included)."""
        return [r for r in self.requests if r.method == "POST" and r.url.path == path]

    def negotiation(self, negotiation_id: str) -> NegotiationPublic:
        """A negotiation as it stands now, every round included."""
        return NegotiationPublic.model_validate(self.negotiations[negotiation_id])

    async def next_negotiation(self, timeout: float = 5.0) -> NegotiationPublic:
        """The next negotiation the controller opened (waiting up to `timeout` s), as the provider first answered it.

        Each call returns the next one in order, so a test reads them one by one; `negotiation(id)` shows what became
        of it (accepted, countered, ...).
        """
        deadline = time.monotonic() + timeout
        while self._taken >= len(self.opened):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the controller opened no new negotiation within {timeout} s")
            await asyncio.sleep(0.005)
        self._taken += 1
        return NegotiationPublic.model_validate(self.opened[self._taken - 1])

    # -- dispatch ----------------------------------------------------------------------------------------------------

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, "missing or invalid bearer token")
        if self.flaky and self.rng.random() < self.flaky:
            return _error(503, "flaky provider")
        fault = next((f for f in self.faults if f.path_contains in request.url.path), None)
        if fault is None:
            return self._route(request)
        self.faults.remove(fault)
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.status is None:
            return self._route(request)
        if fault.lose_reply:
            self._route(request)
        if fault.status == 0:
            raise httpx.ReadTimeout("scripted: the reply was lost", request=request)
        reason = "provider unavailable" if fault.status >= 500 else "request refused"
        return _error(fault.status, f"scripted fault: {reason}")

    def _route(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        body: Any = json.loads(request.content) if request.content else {}
        if parts[:2] == ["v1", "jobs"] and len(parts) == 3 and request.method == "GET":
            job = self.jobs.get(parts[2])
            return httpx.Response(200, json=job) if job else _error(404, f"job {parts[2]!r} not found")
        if parts[:2] == ["v1", "event-consumers"] and request.method == "PUT":
            self.consumers[parts[2]] = body
            return httpx.Response(200, json={"name": parts[2], "stream": f"HZ_T_{self.tenant}",
                                             "js_api_prefix": "$JS.hz.API", "filter_subjects": []})
        if parts[:2] == ["v1", "negotiations"]:
            if len(parts) == 2 and request.method == "POST":
                return self._create(request, body)
            if len(parts) == 2 and request.method == "GET":
                return self._list(request)
            negotiation = self.negotiations.get(parts[2])
            if negotiation is None:
                return _error(404, f"negotiation {parts[2]!r} not found")
            if len(parts) == 3 and request.method == "GET":
                return httpx.Response(200, json=negotiation)
            if len(parts) == 4 and request.method == "POST":
                return self._act(negotiation, parts[3], body)
        return _error(404, "no such route")

    # -- negotiations ------------------------------------------------------------------------------------------------

    def _create(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        key = request.headers.get("idempotency-key")
        if not key:
            return _error(422, "Idempotency-Key header is required", field="header.Idempotency-Key")
        fingerprint = json.dumps(body, sort_keys=True)
        if key in self.idempotency:
            negotiation_id, seen = self.idempotency[key]
            if seen != fingerprint:
                return _error(422, "Idempotency-Key reused with a different request")
            return httpx.Response(201, json=self.negotiations[negotiation_id])
        job = self.jobs.get(body.get("job", ""))
        if job is None:
            return _error(404, f"job {body.get('job')!r} not found")
        negotiation_id = str(uuid.uuid4())
        now = _now()
        negotiation: dict[str, Any] = {
            "id": negotiation_id, "job": job["id"], "kind": body["kind"], "state": "offered", "round": 1,
            "terms": body["terms"], "offer": None, "accepted_option": None, "created_at": now, "updated_at": now,
            "rounds": [{"round": 1, "actor": "tenant", "action": "request", "at": now, "terms": body["terms"],
                        "offer": None, "option": None, "note": None}],
        }
        self._answer(negotiation)
        self.negotiations[negotiation_id] = negotiation
        self.idempotency[key] = (negotiation_id, fingerprint)
        self.opened.append(copy.deepcopy(negotiation))
        return httpx.Response(201, json=negotiation)

    def _decide(self, negotiation: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
        """The options to offer (none: decline) and the decline's note."""
        if self.answers or self.policy is not None:
            answer = self.answers.pop(0) if self.answers else self._policy(negotiation)
            return [o.model_dump(mode="json", exclude_none=True) for o in answer.options], answer.note
        terms = negotiation["terms"]
        job = self.jobs[negotiation["job"]]
        option: dict[str, Any] | None
        if negotiation["kind"] == "scale":
            desired = terms.get("desired_workers", job["desired_workers"])
            accept = terms.get("accept_workers") or {"min": desired, "max": desired}
            workers = min(desired, self.capacity[job["id"]], job["max_workers"])
            option = {"workers": workers, "reason": "capacity"} if accept["min"] <= workers <= accept["max"] else None
        elif negotiation["kind"] == "repartition":
            option = {"parallel_plan": terms["parallel_plan"], "reason": "ok"}
        elif negotiation["kind"] == "approve_maintenance":
            if job["desired_workers"] == 0:
                return [], "the job runs on no host now: there is no maintenance of it to approve"
            option = {"reason": f"approve maintenance {terms['notice_id']} now"}
        else:
            option = {"start_at": terms.get("start_after"), "reason": "ok"}
        return ([option], None) if option is not None else ([], "no capacity inside the requested range")

    def _policy(self, negotiation: dict[str, Any]) -> Answer:
        assert self.policy is not None
        return self.policy(NegotiationPublic.model_validate(negotiation))

    def _answer(self, negotiation: dict[str, Any]) -> None:
        """Answer the current round: offer the options decided on, or decline."""
        options, note = self._decide(negotiation)
        now = _now()
        if not options:
            negotiation["state"] = "declined"
            negotiation["rounds"].append({"round": negotiation["round"], "actor": "provider", "action": "decline",
                                          "at": now, "terms": None, "offer": None, "option": None,
                                          "note": note or "declined"})
        else:
            expires = (datetime.now(UTC) + timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
            offered = {"options": options, "expires_at": expires}
            negotiation["state"] = "offered"
            negotiation["offer"] = offered
            negotiation["rounds"].append({"round": negotiation["round"], "actor": "provider", "action": "offer",
                                          "at": now, "terms": None, "offer": offered, "option": None, "note": None})
        negotiation["updated_at"] = now

    def _act(self, negotiation: dict[str, Any], action: str, body: Any) -> httpx.Response:
        if negotiation["state"] != "offered":
            return _error(409, f"negotiation is {negotiation['state']}; {action} needs an open offer")
        now = _now()
        record = {"round": negotiation["round"], "actor": "tenant", "action": action, "at": now, "terms": None,
                  "offer": None, "option": None, "note": body.get("reason") if isinstance(body, dict) else None}
        if action == "accept":
            index = body.get("option", 0)
            options = negotiation["offer"]["options"]
            if not 0 <= index < len(options):
                return _error(422, f"option {index} does not exist", field="body.option")
            chosen = options[index]
            job = self.jobs[negotiation["job"]]
            if chosen.get("workers") is not None:
                job["desired_workers"] = chosen["workers"]
            if chosen.get("parallel_plan") is not None:
                job["parallel_plan"] = chosen["parallel_plan"]
            negotiation["state"] = "accepted"
            negotiation["accepted_option"] = chosen
            record["option"] = index
        elif action == "counter":
            negotiation["round"] += 1
            negotiation["terms"] = body
            record.update(round=negotiation["round"], terms=body, action="counter", note=None)
            negotiation["rounds"].append(record)
            self._answer(negotiation)
            return httpx.Response(200, json=negotiation)
        elif action == "reject":
            negotiation["state"] = "rejected"
        elif action == "cancel":
            negotiation["state"] = "cancelled"
        else:
            return _error(404, f"no action {action!r}")
        negotiation["rounds"].append(record)
        negotiation["updated_at"] = now
        return httpx.Response(200, json=negotiation)

    def _list(self, request: httpx.Request) -> httpx.Response:
        params = request.url.params
        items = [n for n in self.negotiations.values()
                 if all(params.get(k) in (None, n[k]) for k in ("job", "state", "kind"))]
        limit = int(params.get("limit", "100"))
        start = int(params.get("cursor", "0"))
        page = [{k: v for k, v in n.items() if k != "rounds"} for n in items[start:start + limit]]
        next_cursor = str(start + limit) if start + limit < len(items) else None
        return httpx.Response(200, json={"items": page, "next_cursor": next_cursor})


def _error(status: int, reason: str, *, field: str | None = None) -> httpx.Response:
    errors = [{"field": field, "message": reason}] if field else []
    return httpx.Response(status, json={"reason": reason, "errors": errors})
