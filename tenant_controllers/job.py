"""`Job`: a handler's view of one job, and the way it asks the provider for changes.

A `Job` is level-based: its fields are the provider's answer to `GET /v1/jobs/{id}`, never a value remembered from an
old event. The runtime re-reads it at every resync, as soon as the controller itself opened a negotiation (which
may change the job), and before the handlers of an event that says the job changed (see `runtime.JOB_CHANGING_KINDS`).

Between those, the view is kept at most `max_age` old (five seconds by default: a safety net for changes no event
announced; each read costs the provider's API CPU, so it is not made more often) without making handlers wait:
an older copy is still handed to the next handler while a background read replaces it (stale-while-revalidate).
Only a copy older than the runtime's `job_stale_limit` (a minute), or none at all, makes the handler wait for a read
(its own, or one under way that is recent enough and postdates our last change), because every event queued behind
that handler waits too. A read before every event would make the REST round trip the ceiling of the event rate, and
a blocking one every `max_age` would stall the events queued behind it (bench/HISTORY.md, 'Less work per event, and
fewer job reads').

Only handlers that take the job (a `job` parameter, or `**kwargs`) cause reads; a `Job` kept some other way (a
closure) shows whatever that copy last was. A background read is applied at the next `ensure_fresh`, never while a
handler runs, so one handler sees one view; a read that started before our own negotiation (or an answer to one of
its offers) is discarded. The first read starts with the runtime (`prefetch`, or the first resync), so the first
event joins it instead of waiting a round trip of its own.

`job.latest(CarbonIntensity)` is the newest carbon event observed for this job (by CloudEvent time, so late or
reordered deliveries never roll it back); it survives restarts.

The negotiation methods send one request and return an `Offer` handle (or raise `Declined`); they never wait for
anything else, so a handler stays short and its outcome is decided by what it returns or raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from harmonaize.events import EventData
from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationState, NegotiationTerms
from harmonaize.rest import JobPublic, NegotiationSummary
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.errors import Declined
from tenant_controllers.idempotency import current_failed_host
from tenant_controllers.offer import Offer
from tenant_controllers.terms import WorkerBounds, build_terms

__all__ = ["Job", "LatestLookup"]

DataT = TypeVar("DataT", bound=EventData)
_log = logging.getLogger("tenant_controllers.job")
LatestLookup = Callable[[str, type[EventData]], EventData | None]


class Job:
    """One of the controller's jobs, as the provider has it now."""

    def __init__(
        self,
        job_id: str,
        *,
        api: ProviderApi,
        latest: LatestLookup | None = None,
        snapshot: JobPublic | Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.id = job_id
        self._clock = clock
        self._api = api
        self._latest = latest or (lambda _job, _model: None)
        self._snapshot = _parse(snapshot) if snapshot is not None else None
        self._fetched_at: float | None = clock() if snapshot is not None else None
        self._generation = 0  # bumped by our own negotiations: reads started before one are discarded
        self._background: asyncio.Task[None] | None = None
        self._background_generation = 0  # the generation the background read started in (joined only if current)
        self._background_started = 0.0  # when it started (joined only if its answer would be young enough)
        self._staged: tuple[int, float, JobPublic] | None = None  # a background read, applied before a handler
        self.memo: dict[str, Any] = {}
        """Scratch space that lives as long as the controller process (not persisted)."""

    def __repr__(self) -> str:
        if self._snapshot is None:
            return f"Job({self.id!r}, not loaded)"
        return f"Job({self.id!r}, workers={self.workers}, plan={self.parallel_plan.value})"

    # -- current state -----------------------------------------------------------------------------------------------

    async def refresh(self) -> Job:
        """Re-read the job from the provider."""
        generation, started = self._generation, self._clock()
        snapshot = _parse(await self._api.get_job(self.id))
        self._apply(generation, started, snapshot)
        return self

    def _apply(self, generation: int, started: float, snapshot: JobPublic) -> None:
        if generation == self._generation and (self._fetched_at is None or started >= self._fetched_at):
            self._snapshot, self._fetched_at = snapshot, started

    async def ensure_fresh(self, max_age: float, *, stale_limit: float | None = None) -> Job:
        """Make the view at most `max_age` seconds old, waiting for the provider only when it must (see above): when
        there is no view, or it is older than `stale_limit` (default twice `max_age`). Then a read under way that will
        do is joined; if it fails or its answer is discarded, the handler reads for itself."""
        limit = 2 * max_age if stale_limit is None else stale_limit
        self._apply_staged()
        age = self._age()
        if age is None or age >= limit:
            if await self._join_background(limit):
                self._apply_staged()
                age = self._age()
            if age is None or age >= limit:
                await self.refresh()
        elif age >= max_age:
            self._start_background()
        return self

    def prefetch(self) -> None:
        """Start reading the job in the background if there is no view yet (the runtime does at start-up): the first
        handler then finds it loaded, or joins the read, instead of waiting a full round trip with every other event of
        the job queued behind it."""
        if self._fetched_at is None and self._staged is None:
            self._start_background()

    def _age(self) -> float | None:
        return None if self._fetched_at is None else self._clock() - self._fetched_at

    def _apply_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            self._apply(*staged)

    def _start_background(self) -> None:
        if self._background is None or self._background.done():
            self._background_generation, self._background_started = self._generation, self._clock()
            self._background = asyncio.create_task(self._refresh_quietly(), name=f"hz-job-refresh-{self.id}")

    async def _join_background(self, limit: float) -> bool:
        """Wait for the background read in flight if its answer could serve: it started after our last change (an
        earlier one is discarded) and less than `limit` ago (an older one is too old on arrival). False when there is
        none such. Shielded: a cancelled handler does not cancel the read."""
        task = self._background
        if (
            task is None
            or task.done()
            or self._background_generation != self._generation
            or self._clock() - self._background_started >= limit
        ):
            return False
        await asyncio.shield(task)
        return True

    async def _refresh_quietly(self) -> None:
        generation, started = self._generation, self._clock()
        try:
            snapshot = _parse(await self._api.get_job(self.id))
        except Exception as exc:  # the next handler waits for a read of its own, with its retry policy
            _log.warning("background read of job %s failed: %s", self.id, exc)
            return
        self._staged = (generation, started, snapshot)

    async def aclose(self) -> None:
        """Stop a background read (the controller is stopping)."""
        task, self._background = self._background, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def invalidate(self) -> None:
        """The job may have changed (we negotiated, or an event said so): the next `ensure_fresh` re-reads it, and a
        read already under way is discarded (it may predate the change)."""
        self._generation += 1
        self._fetched_at = None

    @property
    def snapshot(self) -> JobPublic:
        """The provider's answer to `GET /v1/jobs/{id}`, typed (frozen: a newer view is a new read)."""
        return self._loaded()

    @property
    def spec(self) -> dict[str, Any]:
        """The provider's answer to `GET /v1/jobs/{id}` as JSON-shaped data (a copy)."""
        return self._loaded().model_dump(mode="json")

    @property
    def workers(self) -> int:
        """The agreed number of workers (`desired_workers`; 0 while the job is not placed)."""
        return self._loaded().desired_workers

    @property
    def min_workers(self) -> int:
        return self._loaded().min_workers

    @property
    def max_workers(self) -> int:
        return self._loaded().max_workers

    @property
    def gpus_per_worker(self) -> int:
        return self._loaded().gpus_per_worker

    @property
    def parallel_plan(self) -> ParallelPlan:
        return self._loaded().parallel_plan

    def latest(self, model: type[DataT]) -> DataT | None:
        """The newest `model` event observed for this job (by event time), or None."""
        found = self._latest(self.id, model)
        return found if isinstance(found, model) else None

    def _loaded(self) -> JobPublic:
        if self._snapshot is None:
            raise RuntimeError(f"job {self.id!r} has not been loaded: await job.refresh() first")
        return self._snapshot

    # -- negotiation -------------------------------------------------------------------------------------------------

    async def negotiate(
        self,
        *,
        scale_to: int,
        accept: WorkerBounds | None = None,
        carbon_cap: float | None = None,
        deadline: datetime | timedelta | None = None,
        budget_gpu_hours: float | None = None,
        replace: str | Sequence[str] | None = None,
        idempotency_key: str | None = None,
    ) -> Offer:
        """Ask to run with `scale_to` workers, accepting any count in `accept` (inclusive).

        `replace` names hosts (as events name them) whose workers should move to healthy hosts. By default, a request
        made while handling a Failure replaces the event's host: keeping the size after a failure means a replacement
        worker, not the failing one. `replace=()` keeps every worker where it is.
        """
        if replace is None:
            failed = current_failed_host()
            replace = () if failed is None else (failed,)
        terms = build_terms(
            scale_to=scale_to, accept=accept, carbon_cap=carbon_cap, deadline=deadline,
            budget_gpu_hours=budget_gpu_hours, replace=(replace,) if isinstance(replace, str) else replace,
        )
        return await self.request(NegotiationKind.SCALE, terms, idempotency_key=idempotency_key)

    async def repartition(
        self,
        plan: ParallelPlan | str,
        *,
        carbon_cap: float | None = None,
        deadline: datetime | timedelta | None = None,
        idempotency_key: str | None = None,
    ) -> Offer:
        """Ask to switch the job's parallel plan (e.g. DDP -> HSDP grouped by locality)."""
        terms = build_terms(plan=plan, carbon_cap=carbon_cap, deadline=deadline)
        return await self.request(NegotiationKind.REPARTITION, terms, idempotency_key=idempotency_key)

    async def defer(
        self,
        *,
        start_after: datetime | timedelta,
        scale_to: int | None = None,
        accept: WorkerBounds | None = None,
        carbon_cap: float | None = None,
        deadline: datetime | timedelta | None = None,
        idempotency_key: str | None = None,
    ) -> Offer:
        """Ask to shift work to later (e.g. low-carbon hours), optionally at another size."""
        terms = build_terms(
            start_after=start_after, scale_to=scale_to, accept=accept, carbon_cap=carbon_cap, deadline=deadline
        )
        return await self.request(NegotiationKind.DEFER, terms, idempotency_key=idempotency_key)

    async def migrate(
        self,
        *,
        region: str,
        carbon_cap: float | None = None,
        deadline: datetime | timedelta | None = None,
        idempotency_key: str | None = None,
    ) -> Offer:
        """Ask to move the job to another region."""
        terms = build_terms(region=region, carbon_cap=carbon_cap, deadline=deadline)
        return await self.request(NegotiationKind.MIGRATE_REGION, terms, idempotency_key=idempotency_key)

    async def approve_maintenance(self, notice_id: str, *, idempotency_key: str | None = None) -> Offer:
        """Ask the provider to let an announced maintenance start now: `notice_id` as the job's Maintenance event
        names it (one whose `early_approval` is true).

        Accepting the offer is the approval. What the cloud made of it comes later, as a provider round of the
        negotiation (`approved`, `approval_failed`, or `approval_pending` while a shared host waits for its other
        tenants): read it with `ProviderApi.get_negotiation`. Raises Declined when the job runs on no host.
        """
        terms = NegotiationTerms(notice_id=notice_id)
        return await self.request(NegotiationKind.APPROVE_MAINTENANCE, terms, idempotency_key=idempotency_key)

    async def request(
        self, kind: NegotiationKind, terms: NegotiationTerms, *, idempotency_key: str | None = None
    ) -> Offer:
        """Open a negotiation of any kind with explicit terms; raises Declined when nothing can be offered."""
        self.invalidate()
        negotiation = await self._api.create_negotiation(
            job=self.id, kind=kind, terms=terms, idempotency_key=idempotency_key
        )
        if negotiation.state is NegotiationState.DECLINED:
            raise Declined(negotiation)
        return Offer(negotiation, api=self._api, on_change=self.invalidate)

    def negotiations(
        self,
        *,
        state: NegotiationState | str | None = None,
        kind: NegotiationKind | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[NegotiationSummary]:
        """This job's negotiations, in the order the provider pages them (each one's current state; its rounds are
        in `ProviderApi.get_negotiation`)."""
        return self._api.list_negotiations(job=self.id, state=state, kind=kind, since=since, until=until)

    async def open_offers(self) -> list[Offer]:
        """Negotiations of this job still waiting for our answer (e.g. left open by a crashed run)."""
        self.invalidate()  # the caller is about to answer them, which may change the job
        return [
            Offer(n, api=self._api, on_change=self.invalidate)
            async for n in self.negotiations(state=NegotiationState.OFFERED)
        ]


def _parse(answer: JobPublic | Mapping[str, Any]) -> JobPublic:
    """A reply already parsed by `ProviderApi`, or the same body as JSON data (a stand-in API, a saved snapshot)."""
    return answer if isinstance(answer, JobPublic) else JobPublic.model_validate(answer)
