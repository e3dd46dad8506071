"""A tenant's negotiations: open one (idempotently), answer the provider's offer, read the history.

Every route is scoped by the caller's tenant (`NegotiationCall`, which authenticates as `CurrentTenant` does):
another tenant's negotiation id is "negotiation not found", exactly like an id that never existed. Invalid moves are
409 naming the current state ("negotiation is accepted: cannot counter").
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse
from pydantic import StringConstraints

from api.deps import NegotiationCallDep
from api.schemas import AcceptBody, CloseBody
from api.services import negotiation_accept
from api.services import negotiations as service
from api.services.negotiation_history import MAX_PAGE, HistoryFilter, get_negotiation, list_negotiations
from api.services.negotiation_views import public, summary
from harmonaize.ids import JobId
from harmonaize.negotiation import NegotiationKind, NegotiationRequest, NegotiationState, NegotiationTerms
from harmonaize.rest import NegotiationPage, NegotiationPublic
from harmonaize.times import UtcDatetime

router = APIRouter(tags=["negotiations"])

NegotiationId = Annotated[
    str, StringConstraints(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
]
IdempotencyKey = Annotated[
    str,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[\x20-\x7e]+$",
        description="Unique per logical request (1-200 printable ASCII characters); a retry with the same key and "
        "body gets the first response again.",
    ),
]


@router.post("/negotiations", status_code=201, response_model=NegotiationPublic)
async def open_negotiation(
    body: NegotiationRequest, idempotency_key: IdempotencyKey, call: NegotiationCallDep
) -> JSONResponse:
    """Ask for a change to a job; the provider answers at once with an offer or a decline (201 either way)."""
    stored = await service.open_negotiation(
        call.session, tenant_id=call.tenant.id, idempotency_key=idempotency_key, request=body, ctx=call.ctx
    )
    call.wake()
    return JSONResponse(stored.body, status_code=stored.status)


@router.get("/negotiations")
async def list_tenant_negotiations(
    call: NegotiationCallDep,
    job: Annotated[JobId | None, Query()] = None,
    state: Annotated[NegotiationState | None, Query()] = None,
    kind: Annotated[NegotiationKind | None, Query()] = None,
    since: Annotated[UtcDatetime | None, Query(description="Created at or after (RFC 3339 with offset).")] = None,
    until: Annotated[UtcDatetime | None, Query(description="Created before (RFC 3339 with offset).")] = None,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
) -> NegotiationPage:
    """The caller's negotiations, newest first, one page at a time."""
    where = HistoryFilter(job=job, state=state, kind=kind, since=since, until=until)
    page, next_cursor = await list_negotiations(
        call.session, tenant_id=call.tenant.id, now=call.ctx.now, where=where, cursor=cursor, limit=limit
    )
    return NegotiationPage(items=[summary(negotiation) for negotiation in page], next_cursor=next_cursor)


@router.get("/negotiations/{negotiation_id}")
async def get_tenant_negotiation(negotiation_id: NegotiationId, call: NegotiationCallDep) -> NegotiationPublic:
    """One negotiation with every round."""
    return public(await get_negotiation(
        call.session, tenant_id=call.tenant.id, negotiation_id=negotiation_id, now=call.ctx.now
    ))


@router.post("/negotiations/{negotiation_id}/accept")
async def accept(negotiation_id: NegotiationId, body: AcceptBody, call: NegotiationCallDep) -> NegotiationPublic:
    """Take one option of the current offer; 409 (nothing changed) if its capacity is gone or the offer expired."""
    record = await negotiation_accept.accept(
        call.session, tenant_id=call.tenant.id, negotiation_id=negotiation_id, option=body.option, ctx=call.ctx
    )
    call.wake()
    return public(record)


@router.post("/negotiations/{negotiation_id}/counter")
async def counter(negotiation_id: NegotiationId, body: NegotiationTerms, call: NegotiationCallDep) -> NegotiationPublic:
    """Answer the offer with new terms; the provider answers in a new round (offered again, or declined)."""
    record = await service.counter(
        call.session, tenant_id=call.tenant.id, negotiation_id=negotiation_id, terms=body, ctx=call.ctx
    )
    call.wake()
    return public(record)


@router.post("/negotiations/{negotiation_id}/reject")
async def reject(
    negotiation_id: NegotiationId, call: NegotiationCallDep, body: CloseBody | None = None
) -> NegotiationPublic:
    """Turn the offer down; the negotiation ends."""
    note = body.reason if body else None
    record = await service.reject(
        call.session, tenant_id=call.tenant.id, negotiation_id=negotiation_id, note=note, ctx=call.ctx
    )
    call.wake()
    return public(record)


@router.post("/negotiations/{negotiation_id}/cancel")
async def cancel(
    negotiation_id: NegotiationId, call: NegotiationCallDep, body: CloseBody | None = None
) -> NegotiationPublic:
    """Withdraw the request; the negotiation ends."""
    note = body.reason if body else None
    record = await service.cancel(
        call.session, tenant_id=call.tenant.id, negotiation_id=negotiation_id, note=note, ctx=call.ctx
    )
    call.wake()
    return public(record)
