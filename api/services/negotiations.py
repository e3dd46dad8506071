"""Negotiation use cases: open (idempotent), counter, accept, reject, cancel. No FastAPI; each one commits.

The provider's side of every round is the pure policy (`negotiation_policy.decide`), fed with what this module reads
in the same transaction: the job, the free capacity per host from the ledger, the carbon forecast. Time comes from
the caller (`NegotiationContext.now`), never from the wall clock, so expiry is testable without sleeping.

Acceptance is one transaction: the guarded state change (two accepts cannot both win), the ledger change for the
worker delta (scale up: new workers placed near the job's existing ones; scale down: its most recent workers
released), the job's `desired_workers` / `parallel_plan`, the new desired state of every host touched, the round and
the tenant's event. An option that replaces hosts (`replaced_hosts`: the tenant's failing hosts) moves the job's
workers off them in the same transaction (`worker_replacement`), so the job gets a new epoch on the new host set, and
no later offer or placement for the job uses those hosts for a while (`worker_replacement.QUARANTINE`). If
capacity has gone meanwhile, everything rolls back and the offer stays open (the tenant can counter); an offer whose
expiry has passed is marked expired instead and cannot be accepted. The accept of a maintenance approval changes no
capacity: it queues the approval for the agents of the job's hosts, in their desired state (`maintenance_approvals`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Host, Job, Negotiation, NegotiationRound
from api.services import idempotency
from api.services.carbon_forecast import CarbonForecast
from api.services.errors import ConflictError, InsufficientCapacityError, InvalidRequestError, NotFoundError
from api.services.host_assignments import job_hosts, placed_hosts, write_host_assignments
from api.services.idempotency import StoredResponse
from api.services.ledger import change_job_workers, place_workers, release_workers
from api.services.ledger_lock import lock_ledger
from api.services.maintenance_approvals import queue_approval
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
    NegotiationRecord,
    announce,
    append_round,
    change_state,
    expire,
    load,
    load_record,
    offer_of,
    public,
)
from api.services.standby import stand_by, stand_down
from api.services.worker_replacement import avoided_hosts, move_workers, resolve
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


async def _free_capacity(session: AsyncSession, *, exclude: Collection[str] = ()) -> FreeCapacity:
    """Free GPUs per healthy host: not down, and not one the request replaces."""
    free = Host.gpus - Host.allocated_gpus
    query = select(Host.locality_group, free).where(free > 0, Host.down_at.is_(None)).order_by(Host.id)
    if exclude:
        query = query.where(Host.id.not_in(list(exclude)))
    rows = await session.execute(query)
    return FreeCapacity(hosts=tuple((group, int(gpus)) for group, gpus in rows))


async def _job(session: AsyncSession, tenant_id: str, job_id: str) -> Job:
    job = await session.get(Job, (tenant_id, job_id), populate_existing=True)
    if job is None:
        raise NotFoundError("job not found")
    return job


async def _answer(
    session: AsyncSession, job: Job, kind: NegotiationKind, terms: NegotiationTerms, ctx: NegotiationContext
) -> tuple[NegotiationState, dict[str, object], str]:
    """Run the policy: (stored state, columns to set, the round's note)."""
    replacing = await resolve(session, job, terms.replace_hosts, secret=ctx.pseudonym_secret)
    avoided = await avoided_hosts(session, job, secret=ctx.pseudonym_secret, now=ctx.now)
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
        capacity=await _free_capacity(session, exclude=replacing.host_ids | avoided),
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


async def _record_answer(
    session: AsyncSession, negotiation: Negotiation, state: NegotiationState, note: str, now: datetime,
    *, seq: int | None = None,
) -> NegotiationRound:
    action = RoundAction.OFFER if state is NegotiationState.OFFERED else RoundAction.DECLINE
    step = await append_round(session, negotiation, action, at=now, offer=offer_of(negotiation), note=note, seq=seq)
    announce(session, negotiation, now=now)
    return step


async def _open(
    session: AsyncSession, *, tenant_id: str, request: NegotiationRequest, ctx: NegotiationContext
) -> NegotiationRecord:
    job = await _job(session, tenant_id, request.job)
    next_status(Step.NEW, RoundAction.REQUEST)
    negotiation = Negotiation(
        id=uuid7(),
        tenant_id=tenant_id,
        job_id=job.id,
        kind=request.kind,
        state=NegotiationState.OFFERED,
        round=1,
        terms=request.terms.model_dump(mode="json"),
        version=1,
        created_at=ctx.now,
        updated_at=ctx.now,
    )
    state, values, note = await _answer(session, job, request.kind, request.terms, ctx)
    negotiation.state = state
    for name, value in values.items():
        setattr(negotiation, name, value)
    session.add(negotiation)
    await session.flush()  # the row first: its rounds and outbox event refer to it
    # A new negotiation's steps are 1 (the request) and 2 (the answer): no max(seq) reads, no re-read afterwards.
    request_step = await append_round(session, negotiation, RoundAction.REQUEST, at=ctx.now, terms=request.terms, seq=1)
    answer_step = await _record_answer(session, negotiation, state, note, ctx.now, seq=2)
    await _warm_joiners(session, negotiation, job, ctx)
    return NegotiationRecord(negotiation=negotiation, rounds=[request_step, answer_step])


async def _warm_joiners(
    session: AsyncSession, negotiation: Negotiation, job: Job, ctx: NegotiationContext, *,
    dropped: Collection[str] = (),
) -> None:
    """Start the joiners of the offer now made (if it grows the job) and stop those of the one it replaces
    (`dropped`): their hosts' assignments are rewritten in this transaction (`api.services.standby`)."""
    if negotiation.state is NegotiationState.OFFERED:
        await lock_ledger(session)  # host assignments are written under the ledger lock, as the accept writes them
        avoided = await avoided_hosts(session, job, secret=ctx.pseudonym_secret, now=ctx.now)
        hosts = await stand_by(session, negotiation, job, now=ctx.now, secret=ctx.pseudonym_secret, avoid=avoided)
    else:
        hosts = set()
    if hosts or dropped:
        await write_host_assignments(session, hosts | set(dropped), now=ctx.now)


async def open_negotiation(
    session: AsyncSession, *, tenant_id: str, idempotency_key: str, request: NegotiationRequest,
    ctx: NegotiationContext,
) -> StoredResponse:
    """Open a negotiation and answer it (201 with `NegotiationPublic`), or replay the key's first response.

    IdempotencyKeyReusedError (422) when the key came with another body; NotFoundError for an unknown job.
    """
    request_fingerprint = idempotency.fingerprint(request.model_dump(mode="json"))
    lookup = {"tenant_id": tenant_id, "key": idempotency_key, "request_fingerprint": request_fingerprint}
    stored = await idempotency.lookup(session, **lookup)
    if stored is not None:
        await session.rollback()
        return stored
    try:
        claimed = await idempotency.claim(session, **lookup, now=ctx.now)
        record = await _open(session, tenant_id=tenant_id, request=request, ctx=ctx)
        response = StoredResponse(status=201, body=public(record).model_dump(mode="json"))
        idempotency.remember(claimed, response)
        await session.commit()
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


async def _load_open(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, action: RoundAction, now: datetime
) -> Negotiation:
    """The negotiation, if `action` is allowed now; an offer found expired is marked so (committed) and refused."""
    negotiation = await load(session, tenant_id=tenant_id, negotiation_id=negotiation_id)
    if await expire(session, negotiation, now=now):
        await session.commit()
    next_status(negotiation.state, action)
    return negotiation


async def _finish(session: AsyncSession, negotiation: Negotiation) -> NegotiationRecord:
    record = await load_record(session, negotiation)
    await session.commit()
    return record


async def counter(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, terms: NegotiationTerms, ctx: NegotiationContext
) -> NegotiationRecord:
    """The tenant's new terms; the provider answers in a new round (offered again, or declined)."""
    try:
        await lock_ledger(session)  # first: the answer may rewrite host assignments (warm joiners)
        negotiation = await _load_open(
            session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=RoundAction.COUNTER, now=ctx.now
        )
        if negotiation.round >= MAX_ROUNDS:
            raise ConflictError(f"negotiation has reached {MAX_ROUNDS} rounds: accept, reject or start a new one")
        job = await _job(session, tenant_id, negotiation.job_id)
        state, values, note = await _answer(session, job, negotiation.kind, terms, ctx)
        round_number = negotiation.round + 1
        await change_state(
            session, negotiation, RoundAction.COUNTER, now=ctx.now, state=state, round=round_number,
            terms=terms.model_dump(mode="json"), **values,
        )
        await append_round(session, negotiation, RoundAction.COUNTER, at=ctx.now, terms=terms)
        await _record_answer(session, negotiation, state, note, ctx.now)
        await _warm_joiners(session, negotiation, job, ctx, dropped=await stand_down(session, negotiation.id))
        return await _finish(session, negotiation)
    except BaseException:
        await session.rollback()
        raise


async def _close(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, action: RoundAction, note: str | None, now: datetime
) -> NegotiationRecord:
    try:
        await lock_ledger(session)  # first: the warm joiners' hosts are rewritten
        negotiation = await _load_open(
            session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=action, now=now
        )
        await change_state(session, negotiation, action, now=now)
        await append_round(session, negotiation, action, at=now, note=note)
        announce(session, negotiation, now=now)
        standby_hosts = await stand_down(session, negotiation.id)
        if standby_hosts:
            await write_host_assignments(session, standby_hosts, now=now)
        return await _finish(session, negotiation)
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


async def accept(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, option: int, ctx: NegotiationContext
) -> NegotiationRecord:
    """Take option `option` of the current offer and carry it out atomically (see the module docstring).

    InvalidTransitionError (409) unless offered (an expired offer is marked expired); InvalidRequestError (422) for
    an index the offer lacks; InsufficientCapacityError (409) when the workers no longer fit (nothing changes).
    """
    now = ctx.now
    try:
        await lock_ledger(session)
        negotiation = await _load_open(
            session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=RoundAction.ACCEPT, now=now
        )
        offer = offer_of(negotiation)
        assert offer is not None, "an offered negotiation has an offer"
        if option >= len(offer.options):
            raise InvalidRequestError(f"option {option} does not exist: the offer has {len(offer.options)} option(s)")
        chosen = offer.options[option]
        await change_state(session, negotiation, RoundAction.ACCEPT, now=now, accepted_option=option)
        job = await _job(session, tenant_id, negotiation.job_id)
        hosts: set[str] = set()
        avoided = await avoided_hosts(session, job, secret=ctx.pseudonym_secret, now=now)
        if chosen.replaced_hosts and chosen.workers is not None:
            hosts |= await _replace(
                session, job, chosen.replaced_hosts, chosen.workers, ctx, avoid=avoided, expires_at=offer.expires_at
            )
        elif chosen.workers is not None and chosen.workers != job.desired_workers:
            starts_at = chosen.start_at if chosen.start_at is not None and chosen.start_at > now else None
            hosts |= await _resize(
                session, job, chosen.workers, now=now, starts_at=starts_at, avoid=avoided,
                expires_at=offer.expires_at,
            )
        if chosen.parallel_plan is not None and chosen.parallel_plan is not job.parallel_plan:
            await session.execute(
                update(Job)
                .where(Job.tenant_id == job.tenant_id, Job.id == job.id)
                .values(parallel_plan=chosen.parallel_plan)
                .execution_options(synchronize_session=False)
            )
            hosts |= await job_hosts(session, tenant_id=job.tenant_id, job_id=job.id)
        if negotiation.kind is NegotiationKind.APPROVE_MAINTENANCE:
            hosts |= await queue_approval(session, negotiation, job, now=now)
        # the warm joiners' hosts: the accept's own placement makes the ones it uses members, the rest stop
        hosts |= await stand_down(session, negotiation.id)
        await write_host_assignments(session, hosts, now=now)
        await append_round(session, negotiation, RoundAction.ACCEPT, at=now, option=option, note=chosen.reason or None)
        announce(session, negotiation, now=now)
        return await _finish(session, negotiation)
    except BaseException:
        await session.rollback()
        raise


async def _resize(
    session: AsyncSession, job: Job, workers: int, *, now: datetime, starts_at: datetime | None,
    avoid: frozenset[str], expires_at: datetime,
) -> set[str]:
    delta = workers - job.desired_workers
    await change_job_workers(session, job, delta, expected_workers=job.desired_workers)
    if delta < 0:
        return await release_workers(session, job, -delta, now=now)
    try:
        placed = await place_workers(session, job, delta, now=now, starts_at=starts_at, exclude_hosts=avoid)
    except InsufficientCapacityError as exc:
        raise _capacity_gone(exc, expires_at) from exc
    return {placement.allocation.host_id for placement in placed}


async def _replace(
    session: AsyncSession, job: Job, names: Sequence[str], workers: int, ctx: NegotiationContext, *,
    avoid: frozenset[str], expires_at: datetime,
) -> set[str]:
    resolved = await resolve(session, job, names, secret=ctx.pseudonym_secret)
    try:
        return await move_workers(session, job, resolved.host_ids, workers, now=ctx.now, avoid=avoid)
    except InsufficientCapacityError as exc:
        raise _capacity_gone(exc, expires_at) from exc


def _capacity_gone(exc: InsufficientCapacityError, expires_at: datetime) -> InsufficientCapacityError:
    until = expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return InsufficientCapacityError(
        f"the capacity for this option is gone: {exc.reason}. Nothing changed; the offer stays open until "
        f"{until}: counter with fewer workers"
    )


__all__ = [
    "InvalidTransitionError",
    "NegotiationContext",
    "NegotiationRecord",
    "accept",
    "cancel",
    "counter",
    "open_negotiation",
    "reject",
]
