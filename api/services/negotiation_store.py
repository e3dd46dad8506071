"""Reading and writing negotiations: tenant-scoped loads, guarded state changes, rounds, outcome events.

Every change goes through `change_state`: one conditional UPDATE on (id, tenant, state, version) that also bumps the
version. Its rowcount decides a race between two answers to the same offer (two accepts, an accept and the
sweeper's expiry): exactly one wins; the loser learns the state that won and gets an `InvalidTransitionError`
naming it. Each change appends a round (who, what, when, terms or offer) and queues a `NegotiationUpdate` event
for the tenant in the outbox, in the same transaction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Select, Table, Update, bindparam, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import with_expression
from sqlalchemy.orm.attributes import set_committed_value

from api.commit_inserts import queue_insert, write_queued
from api.db import execute_core, rows_matched
from api.models import IdempotencyKey, Job, Negotiation, NegotiationRound, Tenant
from api.models_quarantines import left_recently
from api.models_standby import StandbyNode
from api.services.errors import NotFoundError
from api.services.ledger_hosts import HostSnapshot, snapshot_column, snapshot_from_column
from api.services.ledger_lock import StatementLock
from api.services.negotiation_lifecycle import ACTORS, InvalidTransitionError, next_status
from api.services.negotiation_views import NegotiationRecord, accepted_option_of, offer_of
from api.services.outbox import enqueue_tenant_event
from harmonaize.events import NegotiationUpdate
from harmonaize.negotiation import NegotiationState, NegotiationTerms, Offer, RoundAction

NOT_FOUND = "negotiation not found"
_NEGOTIATIONS = cast("Table", Negotiation.__table__)
_ROUNDS = cast("Table", NegotiationRound.__table__)


async def load(session: AsyncSession, *, tenant_id: str, negotiation_id: str) -> Negotiation:
    """The tenant's negotiation, freshly read; NotFoundError also for another tenant's (indistinguishable)."""
    negotiation = await session.scalar(
        select(Negotiation)
        .where(Negotiation.id == negotiation_id, Negotiation.tenant_id == tenant_id)
        .execution_options(populate_existing=True)
    )
    if negotiation is None:
        raise NotFoundError(NOT_FOUND)
    return negotiation


@dataclass(frozen=True)
class Opened:
    """A negotiation about to change, as `load_for_change` reads it."""

    record: NegotiationRecord
    job: Job | None
    """None if the job is gone."""
    warm: bool
    """Whether it has warm joiners (`api.services.standby`) to stop."""


def _for_change_statement() -> Select[Negotiation, Job, int, NegotiationRound]:
    warm = select(func.count()).where(StandbyNode.negotiation_id == Negotiation.id).correlate(Negotiation)
    return (
        select(Negotiation, Job, warm.scalar_subquery(), NegotiationRound)
        .outerjoin(Job, (Job.tenant_id == Negotiation.tenant_id) & (Job.id == Negotiation.job_id))
        .options(with_expression(Job.left_hosts_recently, left_recently()))
        .outerjoin(NegotiationRound, NegotiationRound.negotiation_id == Negotiation.id)
        .where(Negotiation.id == bindparam("negotiation_id"), Negotiation.tenant_id == bindparam("tenant_id"))
        .order_by(NegotiationRound.seq)
        .execution_options(populate_existing=True)
    )


_FOR_CHANGE = _for_change_statement()
"""Built once: every answer to an offer (accept, counter, reject, cancel) starts with it."""


async def load_for_change(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, quarantine_since: datetime
) -> Opened:
    """`load`, with the negotiation's rounds, its job (and whether it left a host since `quarantine_since`) and
    whether it has warm joiners, all by the same statement.

    The rounds stay exact if the caller's change then wins `change_state`: every step is appended with a change of
    the version (`change_state`, `expire`, the maintenance outcomes), so one appended since this read makes the
    version check fail, and nothing is appended to the negotiation after it wins until its transaction ends.
    The same holds for the warm joiners, written only with a new negotiation or a counter.
    """
    params = {"negotiation_id": negotiation_id, "tenant_id": tenant_id, "quarantine_since": quarantine_since}
    rows = (await session.execute(_FOR_CHANGE, params)).all()
    if not rows:
        raise NotFoundError(NOT_FOUND)
    negotiation, job, warm_rows, _ = rows[0]
    rounds = [step for *_, step in rows if step is not None]
    return Opened(NegotiationRecord(negotiation=negotiation, rounds=rounds), job=job, warm=bool(warm_rows))


_JOB_AGAIN = (
    select(Job)
    .where(Job.tenant_id == bindparam("tenant_id"), Job.id == bindparam("job_id"))
    .options(with_expression(Job.left_hosts_recently, left_recently()))
    .execution_options(populate_existing=True)
)
"""Built once: every accept on PostgreSQL reads its job again once it holds the ledger lock."""


async def read_job_again(session: AsyncSession, job: Job, *, quarantine_since: datetime) -> Job:
    """`job` as it is now, read as `load_for_change` read it (whether it left a host since `quarantine_since`
    included); NotFoundError if it is gone. For a caller that read it before waiting for the ledger lock."""
    params = {"tenant_id": job.tenant_id, "job_id": job.id, "quarantine_since": quarantine_since}
    again = await session.scalar(_JOB_AGAIN, params)
    if again is None:
        raise NotFoundError("job not found")
    return again


def _for_open(dialect: str) -> Select[IdempotencyKey, Job, Any]:
    return (
        select(IdempotencyKey, Job, snapshot_column(dialect))
        .select_from(Tenant)
        .outerjoin(IdempotencyKey, (IdempotencyKey.tenant_id == Tenant.id) & (IdempotencyKey.key == bindparam("key")))
        .outerjoin(Job, (Job.tenant_id == Tenant.id) & (Job.id == bindparam("job_id")))
        .where(Tenant.id == bindparam("tenant_id"))
        .options(with_expression(Job.left_hosts_recently, left_recently()))
        .execution_options(populate_existing=True)
    )


_FOR_OPEN = {dialect: _for_open(dialect) for dialect in ("postgresql", "sqlite")}
"""Built once per dialect (every new request runs it); parameters: the tenant, its key, the job named, the
quarantine's start."""


async def load_for_open(
    session: AsyncSession, *, tenant_id: str, key: str, job_id: str, quarantine_since: datetime
) -> tuple[IdempotencyKey | None, Job | None, HostSnapshot]:
    """The tenant's idempotency key row and the job a new request names (None: absent; the job with whether it
    left a host since `quarantine_since`), and the job's `host_snapshot` for its offer, by one statement."""
    params = {"tenant_id": tenant_id, "key": key, "job_id": job_id, "quarantine_since": quarantine_since}
    statement = _FOR_OPEN[session.get_bind().dialect.name]
    row = (await session.execute(statement, params)).first()
    if row is None:
        return None, None, snapshot_from_column(None)
    return row[0], row[1], snapshot_from_column(row[2])


async def load_record(session: AsyncSession, negotiation: Negotiation) -> NegotiationRecord:
    rounds = await session.scalars(
        select(NegotiationRound)
        .where(NegotiationRound.negotiation_id == negotiation.id)
        .order_by(NegotiationRound.seq)
        .execution_options(populate_existing=True)
    )
    return NegotiationRecord(negotiation=negotiation, rounds=list(rounds))


def new_round(
    negotiation: Negotiation,
    action: RoundAction,
    *,
    seq: int,
    at: datetime,
    terms: NegotiationTerms | None = None,
    offer: Offer | None = None,
    option: int | None = None,
    note: str | None = None,
) -> NegotiationRound:
    """One step of `negotiation` (its round number is the negotiation's current one), not yet written."""
    return NegotiationRound(
        negotiation_id=negotiation.id,
        seq=seq,
        round=negotiation.round,
        actor=ACTORS[action],
        action=action,
        at=at,
        terms=None if terms is None else terms.model_dump(mode="json"),
        offer=None if offer is None else offer.model_dump(mode="json"),
        option=option,
        note=None if note is None else note[:500],
    )


def _queue_round(session: AsyncSession, step: NegotiationRound) -> None:
    """Queue `step` (from `new_round`) for the commit (`api.commit_inserts`); the object stays out of the session
    (the unit of work's flush of it cost more than the statement), and is only read to answer."""
    queue_insert(session, _ROUNDS, {column.key: getattr(step, column.key) for column in _ROUNDS.c})


def queue_opened(
    session: AsyncSession, negotiation: Negotiation, *, terms: NegotiationTerms, answer: RoundAction, note: str,
    now: datetime,
) -> NegotiationRecord:
    """Queue a negotiation just opened (every column set) for the commit: its row, its first two steps (the request
    and the provider's `answer`) and the tenant's event, in the order a flush would write them
    (`api.commit_inserts`; `write_queued` before anything reads them or refers to the row).
    The objects stay out of the session (a flush of them cost about twice the CPU); they are only read to answer."""
    queue_insert(session, _NEGOTIATIONS, {column.key: getattr(negotiation, column.key) for column in _NEGOTIATIONS.c})
    record = NegotiationRecord(negotiation=negotiation, rounds=[
        new_round(negotiation, RoundAction.REQUEST, seq=1, at=now, terms=terms),
        new_round(negotiation, answer, seq=2, at=now, offer=offer_of(negotiation), note=note),
    ])
    for step in record.rounds:
        _queue_round(session, step)
    update_event = negotiation_update(negotiation, now=now)
    enqueue_tenant_event(session, tenant_id=negotiation.tenant_id, job_id=negotiation.job_id, data=update_event,
                         now=now)
    return record


async def append_round(
    session: AsyncSession,
    negotiation: Negotiation,
    action: RoundAction,
    *,
    at: datetime,
    terms: NegotiationTerms | None = None,
    offer: Offer | None = None,
    option: int | None = None,
    note: str | None = None,
    seq: int | None = None,
) -> NegotiationRound:
    """Record one step (the round number is the negotiation's current one).

    `seq`: the step's position when the caller knows it; then neither the `max(seq)` read nor a flush of its own is
    needed, and the step is queued for the commit (`api.commit_inserts`).
    """
    if seq is not None:
        step = new_round(negotiation, action, seq=seq, at=at, terms=terms, offer=offer, option=option, note=note)
        _queue_round(session, step)
        return step
    await write_queued(session)  # the steps this transaction queued count too
    last = await session.scalar(
        select(func.max(NegotiationRound.seq)).where(NegotiationRound.negotiation_id == negotiation.id)
    )
    step = new_round(negotiation, action, seq=int(last or 0) + 1, at=at, terms=terms, offer=offer, option=option,
                     note=note)
    session.add(step)
    await session.flush()
    return step


async def change_state(
    session: AsyncSession, negotiation: Negotiation, action: RoundAction, *, now: datetime,
    then_lock: StatementLock | None = None, **values: Any
) -> NegotiationState:
    """Apply `action` to an offered negotiation if nobody changed it since it was read; returns the new state.

    `values` are the other columns to set (round, terms, offer, ...). For a counter, pass `state` explicitly: the
    table leads to the transient AWAITING_PROVIDER step and the provider's answer decides the stored state.
    `then_lock`: the same statement takes the ledger's lock once the row is written (`ledger_lock`'s
    `lock_in_next_statement`, an accept's).
    """
    target = values.pop("state", None) or next_status(negotiation.state, action)
    assert isinstance(target, NegotiationState), f"{target} is not a stored state"
    params = {f"new_{name}": value for name, value in values.items()}
    params.update(old_id=negotiation.id, old_tenant=negotiation.tenant_id, old_state=negotiation.state,
                  old_version=negotiation.version, new_state=target, new_updated_at=now)
    result = await execute_core(session, _change_statement(tuple(sorted(values)), then_lock), params)
    if rows_matched(result) != 1:
        current = await session.scalar(select(Negotiation.state).where(Negotiation.id == negotiation.id))
        raise InvalidTransitionError(current or negotiation.state, action)
    for name, value in {"state": target, "version": negotiation.version + 1, "updated_at": now, **values}.items():
        set_committed_value(negotiation, name, value)
    return target


@functools.cache
def _change_statement(names: tuple[str, ...], then_lock: StatementLock | None) -> Update:
    """`change_state`'s guarded UPDATE setting `names` besides the state, version and time (and returning the
    ledger's lock, `then_lock`), built once per set of names (a handful) on the table, with parameters: every answer
    to an offer runs one (`api.db.execute_core`)."""
    columns = _NEGOTIATIONS.c
    statement = (
        update(_NEGOTIATIONS)
        .where(
            columns.id == bindparam("old_id"),
            columns.tenant_id == bindparam("old_tenant"),
            columns.state == bindparam("old_state", type_=columns.state.type),
            columns.version == bindparam("old_version"),
        )
        .values(
            state=bindparam("new_state", type_=columns.state.type),
            version=columns.version + 1,
            updated_at=bindparam("new_updated_at", type_=columns.updated_at.type),
            **{name: bindparam(f"new_{name}", type_=columns[name].type) for name in names},
        )
    )
    return statement if then_lock is None else statement.returning(then_lock.column)


def negotiation_update(negotiation: Negotiation, *, now: datetime) -> NegotiationUpdate:
    """The tenant's event for the negotiation's current state."""
    return NegotiationUpdate(
        negotiation_id=negotiation.id,
        kind=negotiation.kind,
        state=negotiation.state,
        round=negotiation.round,
        offer=offer_of(negotiation),
        accepted_option=accepted_option_of(negotiation),
        at=now,
    )


def announce(session: AsyncSession, negotiation: Negotiation, *, now: datetime) -> None:
    """Queue the negotiation's new state as a CloudEvent on the tenant's `negotiation` subject for the job."""
    enqueue_tenant_event(
        session, tenant_id=negotiation.tenant_id, job_id=negotiation.job_id,
        data=negotiation_update(negotiation, now=now), now=now,
    )


async def expire(session: AsyncSession, negotiation: Negotiation, *, now: datetime) -> bool:
    """Mark an offered negotiation whose offer has expired as expired (no commit); False if it was not due or lost
    a race to another change."""
    if negotiation.state is not NegotiationState.OFFERED or negotiation.expires_at is None:
        return False
    if negotiation.expires_at > now:
        return False
    try:
        await change_state(session, negotiation, RoundAction.EXPIRE, now=now)
    except InvalidTransitionError:
        return False
    # its warm joiners stop on their launchers' clocks at this same expiry: only the rows are left to drop
    await session.execute(delete(StandbyNode).where(StandbyNode.negotiation_id == negotiation.id))
    expired_at = negotiation.expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    await append_round(session, negotiation, RoundAction.EXPIRE, at=now, note=f"the offer expired at {expired_at}")
    announce(session, negotiation, now=now)
    return True
