"""The tenant's HTTP client for the provider's control plane (jobs, event consumers, negotiations).

One place turns HTTP into the SDK's errors (see `errors`), and one place decides when a request may be sent again:

* reads (GET) and `PUT /v1/event-consumers/{name}` are idempotent and are simply resent;
* `POST /v1/negotiations` carries an `Idempotency-Key` that stays the same for every resend, so a POST whose reply was
  lost (timeout, 5xx, dropped connection) is replayed by the provider instead of opening a second negotiation;
* actions on a negotiation (accept, counter, reject, cancel) are conditional on the state we read: after an ambiguous
  failure the client re-reads the negotiation and, if it has already moved past the round we acted on, returns that
  instead of acting twice (a counter sent twice would otherwise open two rounds).

Only transient failures are resent, a few times with a short backoff; if they persist the caller gets an
`ApiUnavailableError` (a TemporaryError), and the handler's own retry policy takes over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from harmonaize.events import EventKind
from harmonaize.ids import validate_id
from harmonaize.negotiation import NegotiationKind, NegotiationState, NegotiationTerms
from harmonaize.rest import JobPublic, NegotiationPage, NegotiationPublic, NegotiationSummary
from tenant_controllers.errors import (
    ApiError,
    ApiUnavailableError,
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
)
from tenant_controllers.idempotency import current_traceparent, new_idempotency_key
from tenant_controllers.sources import StreamPosition

__all__ = ["EventConsumerInfo", "ProviderApi"]

_log = logging.getLogger("tenant_controllers.api")

IDEMPOTENCY_HEADER = "Idempotency-Key"


@dataclass(frozen=True)
class EventConsumerInfo:
    """Where to pull a durable consumer's events: `nc.jetstream(prefix=js_api_prefix).pull_subscribe_bind(...)`."""

    name: str
    stream: str
    js_api_prefix: str
    filter_subjects: tuple[str, ...]
    position: str = "broker"
    """Who keeps its ack point across a broker restart: "broker" or "reader" (see `NatsEventSource`)."""
    stream_created: str | None = None
    """Names this incarnation of the stream (a recorded position belongs to one)."""


class _Ambiguous(Exception):
    """A failure after which we cannot know whether the server applied the request."""

    def __init__(self, error: ApiUnavailableError) -> None:
        super().__init__(str(error))
        self.error = error


class ProviderApi:
    """Bearer-authenticated calls to `/v1/...`; `transport` lets tests run the client against a fake or an app."""

    def __init__(
        self,
        *,
        base_url: str,
        token: str,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 10.0,
        attempts: int = 3,
        retry_delay: float = 0.2,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            transport=transport,
            timeout=timeout,
        )
        self._attempts = attempts
        self._retry_delay = retry_delay

    async def __aenter__(self) -> ProviderApi:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- jobs and consumers ------------------------------------------------------------------------------------------

    async def get_job(self, job_id: str) -> JobPublic:
        """The job as the provider has it now (`GET /v1/jobs/{id}`)."""
        reply = await self._request("GET", f"/v1/jobs/{validate_id('job', job_id)}")
        return JobPublic.model_validate(reply.json())

    async def put_event_consumer(
        self,
        name: str,
        *,
        kinds: Sequence[EventKind],
        jobs: Sequence[str],
        ack_wait_s: float | None = None,
        position: str | None = None,
        start_after: StreamPosition | None = None,
    ) -> EventConsumerInfo:
        """Create or update this tenant's durable pull consumer (idempotent). `position` "reader": we keep its ack
        point across broker restarts; `start_after`: a consumer created now starts after it (if the stream is still
        the one it was recorded in)."""
        body: dict[str, Any] = {"kinds": sorted({str(kind) for kind in kinds}), "jobs": sorted(set(jobs))}
        if ack_wait_s is not None:
            body["ack_wait_s"] = ack_wait_s
        if position is not None:
            body["position"] = position
        if start_after is not None:
            body["start_after"] = start_after.sequence
            body["stream_created"] = start_after.stream_created
        reply = await self._request("PUT", f"/v1/event-consumers/{validate_id('consumer', name)}", json=body)
        data = reply.json()
        return EventConsumerInfo(
            name=data["name"],
            stream=data["stream"],
            js_api_prefix=data["js_api_prefix"],
            filter_subjects=tuple(data.get("filter_subjects", ())),
            position=data.get("position", "broker"),
            stream_created=data.get("stream_created"),
        )

    # -- negotiations ------------------------------------------------------------------------------------------------

    async def create_negotiation(
        self,
        *,
        job: str,
        kind: NegotiationKind,
        terms: NegotiationTerms,
        idempotency_key: str | None = None,
    ) -> NegotiationPublic:
        """`POST /v1/negotiations`; every resend carries the same `Idempotency-Key`."""
        body = {
            "job": validate_id("job", job),
            "kind": str(kind),
            "terms": terms.model_dump(mode="json", exclude_none=True),
        }
        key = idempotency_key or new_idempotency_key("POST /v1/negotiations", body)
        reply = await self._request("POST", "/v1/negotiations", json=body, headers={IDEMPOTENCY_HEADER: key})
        return NegotiationPublic.model_validate(reply.json())

    async def get_negotiation(self, negotiation_id: str) -> NegotiationPublic:
        reply = await self._request("GET", f"/v1/negotiations/{_path_token(negotiation_id)}")
        return NegotiationPublic.model_validate(reply.json())

    async def act(
        self,
        negotiation: NegotiationSummary,
        action: str,
        body: Mapping[str, Any] | None = None,
    ) -> NegotiationPublic:
        """`POST /v1/negotiations/{id}/{action}` on the round we read; never applied twice (see the module doc)."""
        if action not in {"accept", "counter", "reject", "cancel"}:
            raise ValueError(f"unknown negotiation action {action!r}")
        path = f"/v1/negotiations/{_path_token(negotiation.id)}/{action}"
        payload = dict(body or {})
        headers = {IDEMPOTENCY_HEADER: new_idempotency_key(f"POST {path}#{negotiation.round}", payload)}
        ambiguous: ApiUnavailableError | None = None
        for attempt in range(self._attempts):
            if ambiguous is not None:
                await asyncio.sleep(self._backoff(attempt, ambiguous))
                current = await self.get_negotiation(negotiation.id)
                if _moved_on(negotiation, current):
                    _log.info("%s on negotiation %s was applied before its reply was lost", action, negotiation.id)
                    return current
            try:
                reply = await self._send_once("POST", path, json=payload, headers=headers)
            except _Ambiguous as exc:
                ambiguous = exc.error
                continue
            return NegotiationPublic.model_validate(reply.json())
        assert ambiguous is not None
        raise ambiguous

    async def list_negotiations(
        self,
        *,
        job: str | None = None,
        state: NegotiationState | str | None = None,
        kind: NegotiationKind | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
    ) -> AsyncIterator[NegotiationSummary]:
        """Every negotiation matching the filters, following `next_cursor` page by page (each one's current state;
        `get_negotiation` has its rounds)."""
        params: dict[str, str] = {"limit": str(limit)}
        optional = {
            "job": job,
            "state": str(state) if state is not None else None,
            "kind": str(kind) if kind is not None else None,
            "since": since.isoformat() if since is not None else None,
            "until": until.isoformat() if until is not None else None,
        }
        params.update({name: value for name, value in optional.items() if value is not None})
        while True:
            reply = await self._request("GET", "/v1/negotiations", params=params)
            page = NegotiationPage.model_validate(reply.json())
            for item in page.items:
                yield item
            if not page.next_cursor:
                return
            params["cursor"] = page.next_cursor

    # -- transport ---------------------------------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send, resending only transient failures; the request must be idempotent (GET, PUT, keyed POST)."""
        last: ApiUnavailableError | None = None
        for attempt in range(self._attempts):
            if last is not None:
                await asyncio.sleep(self._backoff(attempt, last))
            try:
                return await self._send_once(method, path, json=json, params=params, headers=headers)
            except _Ambiguous as exc:
                last = exc.error
                _log.debug("%s %s failed (%s); attempt %d of %d", method, path, last, attempt + 1, self._attempts)
        assert last is not None
        raise last

    async def _send_once(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        trace = current_traceparent()
        if trace is not None:
            headers = {**(headers or {}), "traceparent": trace}
        try:
            reply = await self._client.request(method, path, json=json, params=params, headers=headers)
        except httpx.TransportError as exc:  # timeouts, refused or dropped connections
            raise _Ambiguous(
                ApiUnavailableError(f"cannot reach the provider: {exc!r}", status=None, method=method, url=path)
            ) from exc
        if reply.status_code < 400:
            return reply
        error = _error_for(reply, method=method, url=path)
        if isinstance(error, ApiUnavailableError):
            raise _Ambiguous(error)
        raise error

    def _backoff(self, attempt: int, error: ApiUnavailableError) -> float:
        if error.delay is not None:
            return min(error.delay, 5.0)
        return self._retry_delay * (2.0 ** (attempt - 1))


def _path_token(value: str) -> str:
    if not value or any(ch in value for ch in "/?#%") or not value.isascii():
        raise ValueError(f"not a negotiation id: {value!r}")
    return value


def _moved_on(before: NegotiationSummary, now: NegotiationSummary) -> bool:
    return now.state is not before.state or now.round != before.round


def _error_for(reply: httpx.Response, *, method: str, url: str) -> ApiError:
    reason, errors = _reason_of(reply)
    status = reply.status_code
    kwargs: dict[str, Any] = {"status": status, "method": method, "url": url, "errors": errors}
    if status >= 500 or status == 429:
        retry_after = reply.headers.get("Retry-After", "")
        delay = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
        return ApiUnavailableError(reason, delay=delay, **kwargs)
    if status in (401, 403):
        return AuthenticationError(reason, **kwargs)
    if status == 404:
        return NotFoundError(reason, **kwargs)
    if status == 409:
        return ConflictError(reason, **kwargs)
    if status == 422:
        return InvalidRequestError(reason, **kwargs)
    return ApiError(reason, **kwargs)


def _reason_of(reply: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
    try:
        body = reply.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("reason"), str):
        errors = body.get("errors")
        return body["reason"], [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"], []
    text = reply.text.strip()[:300]
    return text or reply.reason_phrase or f"HTTP {reply.status_code}", []
