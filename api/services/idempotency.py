"""Idempotency keys: a retried POST gets the first response again instead of acting twice.

A tenant sends `Idempotency-Key` with a request that creates something. The first request that completes stores
its response (status and body) under (tenant, key) together with a fingerprint of the request body, in the same
transaction as the effect, so "done" and "remembered" cannot disagree. Later requests with that key:

* same body  -> the stored response, verbatim, even if the object has moved on since (a retry must not see a
  different answer than the one it missed);
* other body -> refused (422): the key was reused for a different request, which is a client bug.

Two concurrent first requests are settled by the primary key: the key's row is inserted, response included, as
the work's commit begins (with its other queued rows, `api.commit_inserts`; no separate claim and update), so on
PostgreSQL the second insert waits for the first transaction and then fails (on SQLite the second request's lookup
already finds the first's row: one writer at a time); the loser rolls all of its work back and replays the winner's
response, so only one effect is ever committed. Failed requests store nothing, so a retry after an error executes again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncSession

from api.commit_inserts import queue_insert
from api.models import IdempotencyKey
from api.services.errors import InvalidRequestError

_KEYS = cast("Table", IdempotencyKey.__table__)


class IdempotencyKeyReusedError(InvalidRequestError):
    """The key was first used with a different request body."""


@dataclass(frozen=True)
class StoredResponse:
    """A response as first sent: replayed byte-for-byte (as JSON) for retries."""

    status: int
    body: Any


def fingerprint(body: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a request body (key order and whitespace do not matter)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


async def lookup(session: AsyncSession, *, tenant_id: str, key: str, request_fingerprint: str) -> StoredResponse | None:
    """The stored response for this key, None for a new key; IdempotencyKeyReusedError for another body."""
    row = await session.get(IdempotencyKey, (tenant_id, key), populate_existing=True)
    return replay(row, request_fingerprint)


def replay(row: IdempotencyKey | None, request_fingerprint: str) -> StoredResponse | None:
    """`lookup` for a key's row read otherwise (together with what a new request needs: one statement)."""
    if row is None:
        return None
    if row.fingerprint != request_fingerprint:
        raise IdempotencyKeyReusedError(
            "this Idempotency-Key was already used with a different request body: use a new key for a new request"
        )
    return StoredResponse(status=row.response_status, body=row.response_body)


def claim(
    session: AsyncSession, *, tenant_id: str, key: str, request_fingerprint: str, response: StoredResponse,
    now: datetime,
) -> None:
    """Queue the key with its response for the commit of the work's transaction (`api.commit_inserts`).

    The commit raises IntegrityError if another request committed the key meanwhile (on PostgreSQL, if one holds it
    uncommitted, once that one commits): the caller then rolls everything back and replays the stored response.
    """
    row = {
        "tenant_id": tenant_id,
        "key": key,
        "fingerprint": request_fingerprint,
        "response_status": response.status,
        "response_body": response.body,
        "created_at": now,
    }
    queue_insert(session, _KEYS, row)
