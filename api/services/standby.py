"""Warm joiners: while an offer to grow a job is open, the hosts its accept would add already run the job's node.

A joiner's start-up (torchrun, imports, building the model) takes seconds. The running ranks never wait for it (they
switch only once every joiner has arrived), but the agreement does: it takes effect only when the joiner is up. The
offer comes before the accept, so the joiner is started then. When an offer that grows the job is made, the option
adding the most workers is placed in a dry run (`ledger.preview_placement`, the ranking the accept itself uses), and
every host it would add to the job gets a `StandbyNode` row. That host's assignment then lists the job under
`standby` until the offer's expiry; its launcher starts the node, whose workers build the model and wait.

The accept places the workers for real: on the same hosts unless the ledger changed meanwhile. The job then appears
in the host's `jobs`, and the launcher gives the waiting node its membership instead of starting one. Any other
answer (counter, reject, cancel) drops the rows and rewrites their hosts. An expired offer's standby stops on the
launcher's own clock at `standby_until`, and its rows go when the expiry is recorded.

A standby reserves nothing: it uses capacity that is free at offer time. A host whose free GPUs are taken meanwhile
runs it beside the new work until the offer closes. Hosts the job already runs on are not warmed, since a node whose
worker count changes restarts anyway.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Job, Negotiation
from api.models_standby import StandbyNode
from api.services.ledger import preview_placement
from api.services.ledger_hosts import HostSnapshot, host_snapshot
from api.services.negotiation_views import offer_of
from api.services.worker_replacement import resolve
from harmonaize.negotiation import NegotiationState

__all__ = ["stand_by", "stand_down"]


async def stand_by(
    session: AsyncSession, negotiation: Negotiation, job: Job, *, now: datetime, secret: bytes,
    avoid: Collection[str] = (), snapshot: HostSnapshot | None = None,
) -> set[str]:
    """Record where `negotiation`'s open offer would add nodes to `job`; returns those hosts (no commit; the caller
    rewrites their assignments). `avoid`: hosts the accept would not use either. `snapshot`: the job's
    `ledger_hosts.host_snapshot` if the caller read it in this transaction already."""
    offer = offer_of(negotiation)
    if offer is None or negotiation.state is not NegotiationState.OFFERED:
        return set()
    if not any(option.workers is not None and (option.workers > job.desired_workers or option.replaced_hosts)
               for option in offer.options):
        return set()  # no option adds a node: nothing to read
    snapshot = await host_snapshot(session, job) if snapshot is None else snapshot
    running_on = set(snapshot.usage)  # the hosts holding any live allocation of the job (effective or reserved)
    best: dict[str, int] = {}
    for option in offer.options:
        if option.workers is None or (option.start_at is not None and option.start_at > now):
            continue
        exclude = set(avoid)
        kept = job.desired_workers
        if option.replaced_hosts:
            resolved = await resolve(session, job, option.replaced_hosts, secret=secret)
            exclude |= resolved.host_ids
            kept -= resolved.replacement.workers
        if option.workers <= kept:
            continue
        plan = await preview_placement(
            session, job, option.workers - kept, exclude_hosts=exclude, snapshot=snapshot
        )
        new_nodes = {host: workers for host, workers in (plan or {}).items() if host not in running_on}
        if sum(new_nodes.values()) > sum(best.values()):
            best = new_nodes
    for host, workers in sorted(best.items()):
        session.add(StandbyNode(negotiation_id=negotiation.id, host_id=host, workers=workers))
    return set(best)  # the rows go with the transaction's next flush


async def stand_down(session: AsyncSession, negotiation_id: str) -> set[str]:
    """Drop `negotiation_id`'s warm joiners; returns their hosts (no commit; the caller rewrites them if needed)."""
    dropped = await session.scalars(
        delete(StandbyNode).where(StandbyNode.negotiation_id == negotiation_id).returning(StandbyNode.host_id)
    )
    return set(dropped)
