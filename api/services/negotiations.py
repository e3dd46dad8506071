"""Negotiation use cases: open (idempotent), counter, reject, cancel. No FastAPI; each one commits.

The provider's side of every round is the pure policy (`negotiation_policy.decide`), fed with what this module reads
in the same transaction: the job, the free capacity per host from the ledger, the carbon forecast. Time comes from
the caller (`NegotiationContext.now`), never from the wall clock, so expiry is testable without sleeping.

Acceptance, the one use case that changes the capacity ledger, is `negotiation_accept`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api.commit_inserts import write_queued
from api.models import Job, Negotiation
from api.services import idempotency
from api.services.carbon_forecast import CarbonForecast
from api.services.errors import ConflictError, NotFoundError
from api.services.host_assignments import placed_hosts, write_host_assignments
from api.services.idempotency import StoredResponse
from api.services.ledger_hosts import HostSnapshot, host_snapshot
from api.services.ledger_lock import lock_ledger
from api.services.negotiation_lifecycle import InvalidTransitionError, Step, next_status
from api.services.negotiation_policy import (
    DEFAULT_OFFER_TTL,
    Decline,
    FreeCapacity,
    JobSnapshot,
    Regions,
    decide,
)
from api.services.negotiation_store import (
    Opened,
    announce,
    append_round,
    change_state,
    expire,
    load_for_change,
    load_for_open,
    queue_opened,
)
from api.services.negotiation_views import NegotiationRecord, offer_of, public
from api.services.standby import stand_by, stand_down
from api.services.worker_replacement import QUARANTINE, avoided_hosts, resolve
from api.single_statement import run_single_statement
from harmonaize.negotiation import NegotiationKind, NegotiationRequest, NegotiationState, NegotiationTerms, RoundAction
from harmonaize.timeids import uuid7

MAX_ROUNDS = 100
"""Counters allowed per negotiation: a controller stuck in a loop ends here instead of growing history forever."""


@dataclass(frozen=True)
class NegotiationContext:
    """What the provider's side needs besides the database: the time, the offer lifetime, carbon and regions."""

    now: datetime
    forecast: CarbonForecast
    region: str
    known_regions: Collection[str] = field(default_factory=tuple)
    offer_ttl: timedelta = DEFAULT_OFFER_TTL
    pseudonym_secret: bytes = b""
    """Resolves the tenant's host names in `replace_hosts` (see `worker_replacement`)."""


def _free_capacity(hosts: HostSnapshot, *, exclude: Collection[str] = ()) -> FreeCapacity:
    """Free GPUs per healthy host (in id order), leaving out the hosts in `exclude`."""
    return FreeCapacity(hosts=tuple((group, gpus) for host, group, gpus in hosts.rooms if host not in exclude))


async def _answer(
    session: AsyncSession, job: Job, kind: NegotiationKind, terms: NegotiationTerms, ctx: NegotiationContext, *,
    avoided: frozenset[str], hosts: HostSnapshot,
) -> tuple[NegotiationState, dict[str, Any], str]:
    """Run the policy: (stored state, columns to set, the round's note). `avoided`: `avoided_hosts` of the job;
    `hosts`: its `host_snapshot`, both read in this transaction (and reused for the warm joiners)."""
    replacing = await resolve(session, job, terms.replace_hosts, secret=ctx.pseudonym_secret)
    decision = decide(
        kind,
        terms,
        job=JobSnapshot(
            min_workers=job.min_workers,
            max_workers=job.max_workers,
            gpus_per_worker=job.gpus_per_worker,
            desired_workers=job.desired_workers,
            parallel_plan=job.parallel_plan,
            placed_hosts=len(placed_hosts(job)),
        ),
        capacity=_free_capacity(hosts, exclude=replacing.host_ids | avoided),
        carbon=ctx.forecast.points(ctx.now),
        regions=Regions(current=ctx.region, known=ctx.known_regions or (ctx.region,)),
        now=ctx.now,
        offer_ttl=ctx.offer_ttl,
        replacing=replacing.replacement,
    )
    if isinstance(decision, Decline):
        state = next_status(Step.AWAITING_PROVIDER, RoundAction.DECLINE)
        return NegotiationState(state), {"offer": None, "expires_at": None}, decision.reason
    state = next_status(Step.AWAITING_PROVIDER, RoundAction.OFFER)
    note = "; ".join(option.reason for option in decision.options if option.reason)
    values = {"offer": decision.model_dump(mode="json"), "expires_at": decision.expires_at}
    return NegotiationState(state), values, note


async def append_step(session: AsyncSession, record: NegotiationRecord, action: RoundAction, **step: Any) -> None:
    """Append a step to `record`, numbered after its last one (the rounds as read with the negotiation, exact once
    the change this step records wins `change_state`: `load_for_change`): no `max(seq)` read, no re-read at the end."""
    seq = record.rounds[-1].seq + 1 if record.rounds else 1
    record.rounds.append(await append_round(session, record.negotiation, action, seq=seq, **step))


def _answer_action(state: NegotiationState) -> RoundAction:
    return RoundAction.OFFER if state is NegotiationState.OFFERED else RoundAction.DECLINE


async def _record_answer(
    session: AsyncSession, record: NegotiationRecord, state: NegotiationState, note: str, now: datetime
) -> None:
    action = _answer_action(state)
    await append_step(session, record, action, at=now, offer=offer_of(record.negotiation), note=note)
    announce(session, record.negotiation, now=now)


async def _open(
    session: AsyncSession, *, tenant_id: str, request: NegotiationRequest, job: Job | None, hosts: HostSnapshot,
    ctx: NegotiationContext,
) -> NegotiationRecord:
    """`hosts`: the job's `host_snapshot`, read with it (`load_for_open`)."""
    if job is None:
        raise NotFoundError("job not found")
    next_status(Step.NEW, RoundAction.REQUEST)
    negotiation = Negotiation(
        id=uuid7(),
        tenant_id=tenant_id,
        job_id=job.id,
        kind=request.kind,
        state=NegotiationState.OFFERED,
        round=1,
        terms=request.terms.model_dump(mode="json"),
        offer=None, expires_at=None, accepted_option=None, version=1,
        created_at=ctx.now,
        updated_at=ctx.now,
    )
    avoided = await avoided_hosts(session, job, secret=ctx.pseudonym_secret, now=ctx.now)
    state, values, note = await _answer(session, job, request.kind, request.terms, ctx, avoided=avoided, hosts=hosts)
    negotiation.state = state
    for name, value in values.items():
        setattr(negotiation, name, value)
    record = queue_opened(
        session, negotiation, terms=request.terms, answer=_answer_action(state), note=note, now=ctx.now
    )
    await _warm_joiners(session, negotiation, job, ctx, avoided=avoided, hosts=hosts, queued=True)
    return record


async def _warm_joiners(
    session: AsyncSession, negotiation: Negotiation, job: Job, ctx: NegotiationContext, *, avoided: frozenset[str],
    hosts: HostSnapshot, dropped: Collection[str] = (), queued: bool = False,
) -> None:
    """Start the joiners of the offer now made (if it grows the job) and stop those of the one it replaces
    (`dropped`): their hosts' assignments are rewritten in this transaction (`api.services.standby`), under the
    ledger lock, taken here, only then: whatever the caller read before is a hint (an offer, a guess at its
    joiners), never a grant. `queued`: the negotiation's row is still queued (`queue_opened`); it is written first,
    since the joiners' rows refer to it."""
    warmed = await stand_by(
        session, negotiation, job, now=ctx.now, secret=ctx.pseudonym_secret, avoid=avoided, snapshot=hosts
    )
    if warmed or dropped:
        if queued:
            await write_queued(session)
        await lock_ledger(session)
        await write_host_assignments(session, warmed | set(dropped), now=ctx.now)


async def open_negotiation(
    session: AsyncSession, *, tenant_id: str, idempotency_key: str, request: NegotiationRequest,
    ctx: NegotiationContext,
) -> StoredResponse:
    """Open a negotiation and answer it (201 with `NegotiationPublic`), or replay the key's first response.

    On PostgreSQL without BEGIN and COMMIT where its one write is the commit's (`api.single_statement`): an offer
    that starts warm joiners, which lock the ledger, is made again in a transaction.
    IdempotencyKeyReusedError (422) when the key came with another body; NotFoundError for an unknown job.
    """
    return await run_single_statement(
        session,
        partial(
            _open_or_replay, session, tenant_id=tenant_id, idempotency_key=idempotency_key, request=request, ctx=ctx
        ),
    )


async def _open_or_replay(
    session: AsyncSession, *, tenant_id: str, idempotency_key: str, request: NegotiationRequest,
    ctx: NegotiationContext,
) -> StoredResponse:
    request_fingerprint = idempotency.fingerprint(request.model_dump(mode="json"))
    lookup = {"tenant_id": tenant_id, "key": idempotency_key, "request_fingerprint": request_fingerprint}
    key_row, job, hosts = await load_for_open(
        session, tenant_id=tenant_id, key=idempotency_key, job_id=request.job, quarantine_since=ctx.now - QUARANTINE
    )
    stored = idempotency.replay(key_row, request_fingerprint)
    if stored is not None:
        await session.rollback()
        return stored
    try:
        record = await _open(session, tenant_id=tenant_id, request=request, job=job, hosts=hosts, ctx=ctx)
        response = StoredResponse(status=201, body=public(record).model_dump(mode="json"))
        idempotency.claim(session, **lookup, response=response, now=ctx.now)
        await session.commit()  # the key, its response and the negotiation: one commit
        return response
    except IntegrityError:
        await session.rollback()
        stored = await idempotency.lookup(session, **lookup)
        if stored is None:
            raise
        await session.rollback()
        return stored
    except BaseException:
        await session.rollback()
        raise


async def load_open(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, action: RoundAction, now: datetime
) -> tuple[Opened, Job]:
    """The negotiation with its rounds and its job (one read: `load_for_change`), if `action` is allowed now; an
    offer found expired is marked so (committed) and refused."""
    since = now - QUARANTINE
    opened = await load_for_change(session, tenant_id=tenant_id, negotiation_id=negotiation_id, quarantine_since=since)
    negotiation = opened.record.negotiation
    if await expire(session, negotiation, now=now):
        await session.commit()
    next_status(negotiation.state, action)
    if opened.job is None:
        raise NotFoundError("job not found")
    return opened, opened.job


async def stand_down_warm(session: AsyncSession, opened: Opened) -> set[str]:
    """`stand_down`, without a statement when the negotiation had no warm joiners when read."""
    return await stand_down(session, opened.record.negotiation.id) if opened.warm else set()


async def finish(session: AsyncSession, record: NegotiationRecord) -> NegotiationRecord:
    await session.commit()
    return record


async def counter(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, terms: NegotiationTerms, ctx: NegotiationContext
) -> NegotiationRecord:
    """The tenant's new terms; the provider answers in a new round (offered again, or declined)."""
    try:
        opened, job = await load_open(
            session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=RoundAction.COUNTER, now=ctx.now
        )
        record, negotiation = opened.record, opened.record.negotiation
        if negotiation.round >= MAX_ROUNDS:
            raise ConflictError(f"negotiation has reached {MAX_ROUNDS} rounds: accept, reject or start a new one")
        avoided = await avoided_hosts(session, job, secret=ctx.pseudonym_secret, now=ctx.now)
        hosts = await host_snapshot(session, job)
        state, values, note = await _answer(session, job, negotiation.kind, terms, ctx, avoided=avoided, hosts=hosts)
        round_number = negotiation.round + 1
        await change_state(
            session, negotiation, RoundAction.COUNTER, now=ctx.now, state=state, round=round_number,
            terms=terms.model_dump(mode="json"), **values,
        )
        await append_step(session, record, RoundAction.COUNTER, at=ctx.now, terms=terms)
        await _record_answer(session, record, state, note, ctx.now)
        dropped = await stand_down_warm(session, opened)
        await _warm_joiners(session, negotiation, job, ctx, avoided=avoided, hosts=hosts, dropped=dropped)
        return await finish(session, record)
    except BaseException:
        await session.rollback()
        raise


async def _close(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, action: RoundAction, note: str | None, now: datetime
) -> NegotiationRecord:
    try:
        opened, _job = await load_open(
            session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=action, now=now
        )
        record, negotiation = opened.record, opened.record.negotiation
        await change_state(session, negotiation, action, now=now)
        await append_step(session, record, action, at=now, note=note)
        announce(session, negotiation, now=now)
        standby_hosts = await stand_down_warm(session, opened)
        if standby_hosts:  # their warm joiners stop: the hosts are rewritten, under the ledger lock
            await lock_ledger(session)
            await write_host_assignments(session, standby_hosts, now=now)
        return await finish(session, record)
    except BaseException:
        await session.rollback()
        raise


async def reject(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, note: str | None, ctx: NegotiationContext
) -> NegotiationRecord:
    """The tenant turns the offer down; the negotiation ends."""
    return await _close(
        session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=RoundAction.REJECT, note=note, now=ctx.now
    )


async def cancel(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, note: str | None, ctx: NegotiationContext
) -> NegotiationRecord:
    """The tenant withdraws its request; the negotiation ends."""
    return await _close(
        session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=RoundAction.CANCEL, note=note, now=ctx.now
    )


__all__ = [
    "InvalidTransitionError",
    "NegotiationContext",
    "NegotiationRecord",
    "append_step",
    "cancel",
    "counter",
    "finish",
    "load_open",
    "open_negotiation",
    "reject",
    "stand_down_warm",
]
