"""The negotiation vocabulary shared by the provider's API and the tenant SDK.

A negotiation is a short conversation about one job: the tenant asks (scale, repartition, defer, migrate region,
approve a maintenance early) with a desired value, an acceptable range and constraints; the provider answers with an
offer of one or more options, each valid until an expiry ("3 workers now", or "4 workers from 02:00 when carbon is
forecast at 210 g"); the tenant accepts one option, rejects, counters with new terms, or cancels. Every round is
stored by the provider. A scale request may name hosts of the job to replace (`replace_hosts`, as a Failure event
names them): the provider's option then moves those workers to healthy hosts (`replaced_hosts`), or says why it
cannot.

`approve_maintenance` is the tenant's "go ahead now" for a maintenance notice whose `early_approval` is true: its
terms name the notice as the tenant's Maintenance event does (`notice_id`). Once accepted, the provider's agents ask
the cloud to start it early; their outcome is added to the negotiation's history as a provider round (`approved`,
`approval_failed`, or `approval_pending` while a shared host waits for its other tenants), the state staying
`accepted`.

States (the transition table itself lives with the provider, who enforces it):

    offered   --accept-->  accepted   (terminal; the capacity ledger and desired placement change atomically)
    offered   --reject-->  rejected   (terminal)
    offered   --counter--> offered    (a new round with a new offer) | declined
    offered   --cancel-->  cancelled  (terminal)
    offered   --expiry-->  expired    (terminal; an expired offer cannot be accepted)
    (request) ---------->  offered | declined (the provider can offer nothing inside the tenant's range)
"""

from __future__ import annotations

import enum
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from harmonaize.ids import JobId
from harmonaize.jobs import ParallelPlan
from harmonaize.ranges import MAX_WORKERS, WorkerRange
from harmonaize.times import UtcDatetime

MAX_OPTIONS = 8
MAX_REPLACE_HOSTS = 16
HOST_PSEUDONYM_PATTERN = r"^h-[0-9a-f]{6,32}$"
"""A host as the tenant's events name it: the shape of `harmonaize.events.fields.HostPseudonym`, spelled out here
because the events package imports this module."""
HostName = Annotated[str, StringConstraints(pattern=HOST_PSEUDONYM_PATTERN)]
NOTICE_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""A maintenance notice as the tenant's events name it: `harmonaize.events.fields.NoticeId`, spelled out for the same
reason."""
NoticeName = Annotated[str, StringConstraints(pattern=NOTICE_ID_PATTERN)]


class NegotiationKind(enum.StrEnum):
    SCALE = "scale"  # change the number of workers
    REPARTITION = "repartition"  # change the parallel plan (DDP / FSDP / HSDP)
    DEFER = "defer"  # shift work in time (e.g. to low-carbon hours)
    MIGRATE_REGION = "migrate_region"  # move to another region
    APPROVE_MAINTENANCE = "approve_maintenance"  # let an announced maintenance start now (`early_approval`)


class NegotiationState(enum.StrEnum):
    OFFERED = "offered"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    DECLINED = "declined"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self is not NegotiationState.OFFERED


class Actor(enum.StrEnum):
    TENANT = "tenant"
    PROVIDER = "provider"


class RoundAction(enum.StrEnum):
    REQUEST = "request"
    OFFER = "offer"
    DECLINE = "decline"
    COUNTER = "counter"
    ACCEPT = "accept"
    REJECT = "reject"
    CANCEL = "cancel"
    EXPIRE = "expire"
    APPROVAL_PENDING = "approval_pending"  # approve_maintenance: the agents cannot approve yet (the host is shared)
    APPROVED = "approved"  # approve_maintenance: the cloud accepted the early start
    APPROVAL_FAILED = "approval_failed"  # approve_maintenance: no early start; the note says why


class _Terms(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Constraints(_Terms):
    """What must hold for an option to be acceptable to the tenant."""

    deadline: UtcDatetime | None = Field(default=None, description="The change must take effect before this time.")
    carbon_cap_g_per_kwh: float | None = Field(default=None, ge=0, le=5000)
    budget_gpu_hours: float | None = Field(default=None, ge=0, le=1e7)


class NegotiationTerms(_Terms):
    """What the tenant asks for, in a request or a counter-offer."""

    desired_workers: int | None = Field(default=None, ge=0, le=MAX_WORKERS)
    accept_workers: WorkerRange | None = Field(default=None, description="Worker counts the tenant would accept.")
    parallel_plan: ParallelPlan | None = None
    start_after: UtcDatetime | None = Field(default=None, description="For defer: not before this time.")
    region: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
    replace_hosts: tuple[HostName, ...] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_REPLACE_HOSTS,
        description="For scale: hosts of this job, as its events name them (a Failure's `host`), whose workers should "
        "move to healthy hosts, e.g. after a failure or a predicted failure. A host running none of the job's workers "
        "is ignored.",
    )
    notice_id: NoticeName | None = Field(
        default=None,
        description="For approve_maintenance: the maintenance to start early, as the job's Maintenance event names "
        "it (`notice_id`).",
    )
    constraints: Constraints = Field(default_factory=Constraints)

    @model_validator(mode="after")
    def _desired_in_range(self) -> Self:
        r = self.accept_workers
        if self.desired_workers is not None and r is not None and not r.min <= self.desired_workers <= r.max:
            raise ValueError("desired_workers must lie inside accept_workers")
        if self.replace_hosts is not None and len(set(self.replace_hosts)) != len(self.replace_hosts):
            raise ValueError("replace_hosts names a host twice")
        return self


class OfferOption(_Terms):
    """One thing the provider would do; the tenant accepts at most one option of an offer."""

    workers: int | None = Field(default=None, ge=0, le=MAX_WORKERS)
    parallel_plan: ParallelPlan | None = None
    start_at: UtcDatetime | None = Field(default=None, description="None: as soon as accepted.")
    region: str | None = None
    replaced_hosts: tuple[HostName, ...] | None = Field(
        default=None,
        description="The job's hosts (as its events name them) that this option takes its workers off; `workers` is "
        "the job's size afterwards, the rest of it on healthy hosts.",
    )
    expected_carbon_g_per_kwh: float | None = Field(default=None, ge=0)
    reason: str = Field(default="", max_length=300)


class Offer(_Terms):
    options: tuple[OfferOption, ...] = Field(min_length=1, max_length=MAX_OPTIONS)
    expires_at: UtcDatetime


class NegotiationRequest(_Terms):
    """The body of `POST /v1/negotiations` (with an `Idempotency-Key` header)."""

    job: JobId
    kind: NegotiationKind
    terms: NegotiationTerms

    @model_validator(mode="after")
    def _terms_fit_kind(self) -> Self:
        problem = terms_problem(self.kind, self.terms)
        if problem is not None:
            where = "terms" if self.terms.notice_id is not None and self.kind is _APPROVE else "terms.notice_id"
            raise PydanticCustomError("terms_kind", "{problem}", {"field": where, "problem": problem})
        return self


_APPROVE = NegotiationKind.APPROVE_MAINTENANCE


def terms_problem(kind: NegotiationKind, terms: NegotiationTerms) -> str | None:
    """Why `terms` cannot go with `kind` (None: they can), for what the other terms cannot express.

    Only the maintenance approval is checked here: it names a notice and nothing else, and nothing else names one.
    Every other mismatch is the provider's to answer (a decline saying why), as it always was.
    """
    named = terms.notice_id is not None
    if kind is not NegotiationKind.APPROVE_MAINTENANCE:
        return f"notice_id is for approve_maintenance requests, not {kind.value}" if named else None
    if not named:
        return "approve_maintenance needs notice_id: the maintenance to approve, as its event names it"
    if terms != NegotiationTerms(notice_id=terms.notice_id):
        return "approve_maintenance takes notice_id only"
    return None
