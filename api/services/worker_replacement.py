"""Replacing a job's workers on hosts the tenant reports failing (or predicted to fail): which hosts, and the move.

Why the tenant names the hosts: a failure that leaves the host up (a GPU error, a prediction) is known to the host's
agent, which tells only the tenants placed there, under each tenant's pseudonym for the host. The control plane keeps
no record of it, so the request carries the pseudonym from the event (`NegotiationTerms.replace_hosts`; the SDK fills
it in for a scale request made while handling a Failure). The provider resolves it only among the job's own hosts,
by computing the tenant's pseudonym of each, so a tenant learns nothing about hosts it does not use, and a name that
matches none of them (a host already released, a made-up name) moves nothing.

The move is one transaction with the rest of the acceptance: every live allocation of the job on those hosts is
released, the job's size becomes the option's, and the difference is placed on other, healthy hosts (never a
replaced one, never a down one), or the job's most recent remaining workers are released when the option is smaller.

Afterwards the job stays off the hosts it replaced for `QUARANTINE` (`avoided_hosts`, from the rows the accept
wrote: `quarantine`): otherwise its next growth request lands on the very slot the replacement freed, on a host still
failing, and two controllers (a failure guard and a carbon scaler) move a worker on and off it every second. A host
that went down after the move and was reported back up since is repaired (or its maintenance is over), and ends
the quarantine early: a job that left a host ahead of announced maintenance may grow back onto it afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import Table, bindparam, delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from api.db import execute_core
from api.models import Allocation, Host, Job
from api.models_quarantines import JobHostQuarantine
from api.services.ledger import change_job_workers, place_workers, release_workers, release_workers_on
from api.services.negotiation_policy import NO_REPLACEMENT, Replacement
from harmonaize.pseudonyms import host_pseudonym

__all__ = [
    "QUARANTINE",
    "ResolvedReplacement",
    "avoided_hosts",
    "avoided_hosts_of_all",
    "move_workers",
    "quarantine",
    "resolve",
]

QUARANTINE = timedelta(hours=1)
"""How long a job's new workers stay off a host it replaced. The control plane has no health record of hosts that are
up, so it cannot tell when the host is repaired; an hour outlasts a predicted failure's usual horizon and a repair is
rarely quicker, while a small fleet does not lose the host to the job for good."""


@dataclass(frozen=True)
class ResolvedReplacement:
    """What the policy sees (pseudonyms and counts) and the internal host ids it stands for (never shown)."""

    replacement: Replacement = NO_REPLACEMENT
    host_ids: frozenset[str] = field(default_factory=frozenset)


async def resolve(
    session: AsyncSession, job: Job, names: Sequence[str] | None, *, secret: bytes
) -> ResolvedReplacement:
    """Map the tenant's host names to the job's hosts holding live allocations, with the workers on them."""
    if not names:
        return ResolvedReplacement()
    rows = await session.execute(
        select(Allocation.host_id, func.sum(Allocation.gpus))
        .where(Allocation.tenant_id == job.tenant_id, Allocation.job_id == job.id, Allocation.released_at.is_(None))
        .group_by(Allocation.host_id)
    )
    by_name = {host_pseudonym(secret, job.tenant_id, host): (host, int(gpus)) for host, gpus in rows}
    present = tuple(name for name in names if name in by_name)
    absent = tuple(name for name in names if name not in by_name)
    workers = sum(by_name[name][1] for name in present) // job.gpus_per_worker
    replacement = Replacement(hosts=present, workers=workers, absent=absent)
    return ResolvedReplacement(replacement=replacement, host_ids=frozenset(by_name[name][0] for name in present))


async def avoided_hosts(session: AsyncSession, job: Job, *, secret: bytes, now: datetime) -> frozenset[str]:
    """The hosts the job replaced in an accepted negotiation within `QUARANTINE` and that were not reported back up
    after an outage since (internal ids). No statement when the read of the job already said it left none."""
    if job.left_hosts_recently is False:
        return frozenset()
    left = await _replaced_since(session, now=now, job=job)
    found = left.get((job.tenant_id, job.id))
    if not found:
        return frozenset()
    hosts = [(host, up_at) for host, up_at in await session.execute(select(Host.id, Host.up_at))]
    return _still_avoided(found, hosts, tenant_id=job.tenant_id, secret=secret)


async def avoided_hosts_of_all(
    session: AsyncSession, hosts: Sequence[Host], *, secret: bytes, now: datetime
) -> dict[tuple[str, str], frozenset[str]]:
    """`avoided_hosts` of every job that has any, keyed by (tenant, job), in one query (the capacity sweep's)."""
    left = await _replaced_since(session, now=now)
    rows = [(host.id, host.up_at) for host in hosts]
    return {key: avoided for key, names in left.items()
            if (avoided := _still_avoided(names, rows, tenant_id=key[0], secret=secret))}


_Q = cast("Table", JobHostQuarantine.__table__).c
_LEFT_SINCE = select(_Q.tenant_id, _Q.job_id, _Q.host_name, _Q.left_at).where(_Q.left_at >= bindparam("since"))
_JOB_LEFT_SINCE = _LEFT_SINCE.where(_Q.tenant_id == bindparam("tenant_id"), _Q.job_id == bindparam("job_id"))
"""Both built once, on the table (`api.db.execute_core`): every offer reads the job's (`avoided_hosts`)."""


async def _replaced_since(
    session: AsyncSession, *, now: datetime, job: Job | None = None
) -> dict[tuple[str, str], dict[str, datetime]]:
    """Per (tenant, job): the host pseudonyms its accepted replacements within `QUARANTINE` moved it off, each with
    when it last left it."""
    params: dict[str, object] = {"since": now - QUARANTINE}
    if job is None:
        query = _LEFT_SINCE
    else:
        query = _JOB_LEFT_SINCE
        params.update(tenant_id=job.tenant_id, job_id=job.id)
    left_at: dict[tuple[str, str], dict[str, datetime]] = {}
    for tenant_id, job_id, name, at in await execute_core(session, query, params):
        names = left_at.setdefault((tenant_id, job_id), {})
        names[name] = max(at, names.get(name, at))
    return left_at


async def quarantine(session: AsyncSession, job: Job, names: Sequence[str], *, now: datetime) -> None:
    """Keep `job` off the hosts it is leaving (the tenant's `names`, as the accepted option named them) from `now`,
    in the caller's transaction; rows older than any quarantine go first, so the table holds about an hour's
    replacements."""
    await session.execute(
        delete(JobHostQuarantine)
        .where(JobHostQuarantine.left_at < now - QUARANTINE)
        .execution_options(synchronize_session=False)
    )
    await session.execute(
        insert(JobHostQuarantine),
        [{"tenant_id": job.tenant_id, "job_id": job.id, "host_name": name, "left_at": now} for name in names],
    )
    set_committed_value(job, "left_hosts_recently", True)


def _still_avoided(
    left_at: dict[str, datetime], hosts: Sequence[tuple[str, datetime | None]], *, tenant_id: str, secret: bytes
) -> frozenset[str]:
    """The hosts (internal ids) among `left_at`'s pseudonyms not reported back up since the job left them."""
    avoided = set()
    for host, up_at in hosts:
        left = left_at.get(host_pseudonym(secret, tenant_id, host))
        if left is not None and (up_at is None or up_at <= left):
            avoided.add(host)
    return frozenset(avoided)


async def move_workers(
    session: AsyncSession,
    job: Job,
    host_ids: frozenset[str],
    workers: int,
    *,
    now: datetime,
    avoid: frozenset[str] = frozenset(),
) -> set[str]:
    """Take the job's workers off `host_ids` and give it `workers` in all on other hosts (never on `avoid` either);
    returns the hosts touched.

    Inside the caller's transaction. The job must still have the size it had when the offer was made (ConflictError
    otherwise); InsufficientCapacityError when the healthy hosts' room is gone (the caller rolls back: nothing moved).
    """
    current = job.desired_workers
    await change_job_workers(session, job, workers - current, expected_workers=current)
    kept = current - await release_workers_on(session, job, host_ids, now=now)
    touched = set(host_ids)
    if workers < kept:
        touched |= await release_workers(session, job, kept - workers, now=now)
    elif workers > kept:
        placed = await place_workers(session, job, workers - kept, now=now, exclude_hosts=host_ids | avoid)
        touched |= {placement.allocation.host_id for placement in placed}
    return touched
