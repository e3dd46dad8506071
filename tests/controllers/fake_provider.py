"""A fake of the provider's REST API, for the fast tier: an httpx transport that keeps jobs and negotiations in memory.

It follows the REST contract the real API implements (`POST /v1/negotiations` with `Idempotency-Key`, actions on
`/v1/negotiations/{id}/{action}`, JSON errors `{"reason", "errors"}`), with a deliberately simple policy: the provider
can give a job at most `capacity[job]` workers; a scale request is offered `min(desired, capacity)` if that lies in the
tenant's range, declined otherwise. Faults are scripted per request (`fail_next`), including the nasty one: the
change is applied and *then* the reply is lost (`lose_reply=True`), which is what idempotency keys exist for.

The real tier runs the same client against the real API; this fake only makes the unit tests fast.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class ScriptedFault:
    status: int = 503
    lose_reply: bool = False  # apply the request, then answer with `status` (or drop the connection if 0)
    path_contains: str = ""


@dataclass
class FakeProvider:
    """Jobs, negotiations and their history; `transport` is what ProviderApi takes."""

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

    def add_job(self, job_id: str, *, min_workers: int = 1, max_workers: int = 4, desired: int = 2,
                plan: str = "ddp", capacity: int | None = None) -> None:
        self.jobs[job_id] = {
            "id": job_id, "name": job_id, "min_workers": min_workers, "max_workers": max_workers,
            "gpus_per_worker": 1, "parallel_plan": plan, "desired_workers": desired, "created_at": _now(),
        }
        self.capacity[job_id] = max_workers if capacity is None else capacity

    def fail_next(self, count: int = 1, *, status: int = 503, lose_reply: bool = False, path_contains: str = "") -> None:
        self.faults.extend(ScriptedFault(status, lose_reply, path_contains) for _ in range(count))

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    def posts(self, path: str = "/v1/negotiations") -> list[httpx.Request]:
        return [r for r in self.requests if r.method == "POST" and r.url.path == path]

    # -- dispatch ----------------------------------------------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, "missing or invalid bearer token")
        if self.flaky and self.rng.random() < self.flaky:
            return _error(503, "flaky provider")
        fault = next((f for f in self.faults if f.path_contains in request.url.path), None)
        if fault is not None:
            self.faults.remove(fault)
            if not fault.lose_reply:
                return self._fault_reply(fault, request)
            self._route(request)
            return self._fault_reply(fault, request)
        return self._route(request)

    def _fault_reply(self, fault: ScriptedFault, request: httpx.Request) -> httpx.Response:
        if fault.status == 0:
            raise httpx.ReadTimeout("scripted: the reply was lost", request=request)
        return _error(fault.status, "scripted fault: provider unavailable")

    def _route(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        body = json.loads(request.content) if request.content else {}
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
        return httpx.Response(201, json=negotiation)

    def _answer(self, negotiation: dict[str, Any]) -> None:
        """The provider's policy: offer what fits, or decline."""
        terms = negotiation["terms"]
        job = self.jobs[negotiation["job"]]
        now = _now()
        option: dict[str, Any] | None
        if negotiation["kind"] == "scale":
            desired = terms.get("desired_workers", job["desired_workers"])
            accept = terms.get("accept_workers") or {"min": desired, "max": desired}
            workers = min(desired, self.capacity[job["id"]], job["max_workers"])
            option = {"workers": workers, "reason": "capacity"} if accept["min"] <= workers <= accept["max"] else None
        elif negotiation["kind"] == "repartition":
            option = {"parallel_plan": terms["parallel_plan"], "reason": "ok"}
        else:
            option = {"start_at": terms.get("start_after"), "reason": "ok"}
        if option is None:
            negotiation["state"] = "declined"
            negotiation["rounds"].append({"round": negotiation["round"], "actor": "provider", "action": "decline",
                                          "at": now, "terms": None, "offer": None, "option": None,
                                          "note": "no capacity inside the requested range"})
        else:
            expires = (datetime.now(UTC) + timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
            offer = {"options": [option], "expires_at": expires}
            negotiation["state"] = "offered"
            negotiation["offer"] = offer
            negotiation["rounds"].append({"round": negotiation["round"], "actor": "provider", "action": "offer",
                                          "at": now, "terms": None, "offer": offer, "option": None, "note": None})
        negotiation["updated_at"] = now

    def _act(self, negotiation: dict[str, Any], action: str, body: dict[str, Any]) -> httpx.Response:
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
