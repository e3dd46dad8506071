"""Accepting an offer: the one negotiation use case that changes the capacity ledger. No FastAPI; it commits.

Acceptance is one transaction: the guarded state change (two accepts cannot both win), the ledger change for the
worker delta (scale up: new workers placed near the job's existing ones; scale down: its most recent workers
released), the job's `desired_workers` / `parallel_plan`, the new desired state of every host touched, the round and
the tenant's event. An option that replaces hosts (`replaced_hosts`: the tenant's failing hosts) moves the job's
workers off them in the same transaction (`worker_replacement`), so the job gets a new epoch on the new host set, and
no later offer or placement for the job uses those hosts for a while (`worker_replacement.QUARANTINE`). If
capacity has gone meanwhile, everything rolls back and the offer stays open (the tenant can counter); an offer whose
expiry has passed is marked expired instead and cannot be accepted. The accept of a maintenance approval changes no
capacity: it queues the approval for the agents of the job's hosts, in their desired state (`maintenance_approvals`).

On PostgreSQL a resize or a new plan holds the ledger shared with the accepts of other jobs and locks only its own
job and hosts (`ledger_lock`'s shared mode), so accepts on different hosts run side by side (its warm joiners' hosts
are those its placement takes, unless the ledger changed since the offer); a replacement or a maintenance approval
holds the whole ledger, as does an accept redone because it needed a row out of the shared mode's order
(`LedgerOrderError`). Either lock is taken by the statement of the accept's state change, once its row is written
(`ledger_lock.lock_in_next_statement`).
"""

from __future__ import annotations

import logging

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Job
from api.services.errors import InvalidRequestError
from api.services.host_assignments import job_hosts, write_host_assignments
from api.services.ledger_lock import REDONE, LedgerOrderError, lock_in_next_statement
from api.services.maintenance_approvals import queue_approval
from api.services.negotiation_resize import replace, resize
from api.services.negotiation_store import announce, change_state, read_job_again
from api.services.negotiation_views import NegotiationRecord, offer_of
from api.services.negotiations import NegotiationContext, append_step, finish, load_open, stand_down_warm
from api.services.worker_replacement import QUARANTINE
from harmonaize.negotiation import NegotiationKind, RoundAction

__all__ = ["accept"]

_log = logging.getLogger(__name__)


async def accept(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, option: int, ctx: NegotiationContext
) -> NegotiationRecord:
    """Take option `option` of the current offer and carry it out atomically (see the module docstring).

    InvalidTransitionError (409) unless offered (an expired offer is marked expired); InvalidRequestError (422) for
    an index the offer lacks; InsufficientCapacityError (409) when the workers no longer fit (nothing changes).
    One that needed a row out of the shared mode's order is redone from the start holding the whole ledger.
    """
    try:
        return await _accept(session, tenant_id=tenant_id, negotiation_id=negotiation_id, option=option, ctx=ctx,
                             whole_ledger=False)
    except LedgerOrderError as reason:
        REDONE.inc()
        _log.debug("accept of negotiation %s redone holding the whole ledger: %s", negotiation_id, reason)
        return await _accept(session, tenant_id=tenant_id, negotiation_id=negotiation_id, option=option, ctx=ctx,
                             whole_ledger=True)


async def _accept(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, option: int, ctx: NegotiationContext,
    whole_ledger: bool,
) -> NegotiationRecord:
    now = ctx.now
    try:
        opened, job = await load_open(
            session, tenant_id=tenant_id, negotiation_id=negotiation_id, action=RoundAction.ACCEPT, now=now
        )
        record, negotiation = opened.record, opened.record.negotiation
        offer = offer_of(negotiation)
        assert offer is not None, "an offered negotiation has an offer"
        if option >= len(offer.options):
            raise InvalidRequestError(f"option {option} does not exist: the offer has {len(offer.options)} option(s)")
        chosen = offer.options[option]
        # the negotiation's own part first, outside the ledger lock: its version guards it (`load_for_change`); the
        # same statement then takes the lock (PostgreSQL)
        shares = not (whole_ledger or chosen.replaced_hosts or negotiation.kind is NegotiationKind.APPROVE_MAINTENANCE)
        async with lock_in_next_statement(session, share_for=(job.tenant_id, job.id) if shares else None) as lock:
            await change_state(session, negotiation, RoundAction.ACCEPT, now=now, accepted_option=option,
                               then_lock=lock)
        await append_step(session, record, RoundAction.ACCEPT, at=now, option=option, note=chosen.reason or None)
        # the job may have changed while the accept waited for the lock (PostgreSQL): read it again, unless the
        # option resizes it, whose counters' update reads it again in the same statement (`resize`'s `read_again`)
        waited = lock is not None
        read_again = now - QUARANTINE if waited else None
        resizes = not chosen.replaced_hosts and chosen.workers not in (None, job.desired_workers)
        if read_again is not None and not resizes:
            job, read_again = await read_job_again(session, job, quarantine_since=read_again), None
        hosts: set[str] = set()
        secret, expires_at = ctx.pseudonym_secret, offer.expires_at
        if chosen.replaced_hosts and chosen.workers is not None:
            hosts |= await replace(
                session, job, chosen.replaced_hosts, chosen.workers, now=now, secret=secret, expires_at=expires_at
            )
        elif chosen.workers is not None and chosen.workers != job.desired_workers:
            starts_at = chosen.start_at if chosen.start_at is not None and chosen.start_at > now else None
            hosts |= await resize(
                session, job, chosen.workers, now=now, starts_at=starts_at, secret=secret, expires_at=expires_at,
                read_again=read_again,
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
        hosts |= await stand_down_warm(session, opened)
        await write_host_assignments(session, hosts, now=now, job=(job.tenant_id, job.id))
        announce(session, negotiation, now=now)  # after the hosts' desired states, in the outbox's order
        return await finish(session, record)
    except BaseException:
        await session.rollback()
        raise
