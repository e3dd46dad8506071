"""The provider's negotiation policy: what to offer for a request, as a pure function of what the caller read.

No database, no web framework, no clock: the caller passes the job, the request, the free capacity it read from the
ledger, a carbon forecast and `now`, and gets an `Offer` (one or more options, each with a reason, valid until
`now + offer_ttl`) or a `Decline` with a reason. That makes every behaviour below a unit test with no set-up.

Rules (a demanding tenant's expectations):

* Nothing is offered outside the tenant's range (`accept_workers`, else exactly `desired_workers`) intersected with
  the job's own `min_workers..max_workers`; an empty intersection is a decline that says both ranges.
* A worker is `gpus_per_worker` GPUs on ONE host, so free capacity is counted per host in whole workers.
* SCALE up: the desired count if it fits now; otherwise the most that fits, if that is still inside the range ("3 now"
  when 4 were asked and there is room for one more). Scaling down always fits and is offered at once.
* Every option must be something the provider can reserve at acceptance: capacity is reserved when the tenant
  accepts, also for a later start. So a later option is a carbon decision, never a bet on capacity freeing up (the
  ledger has no capacity forecast): when a carbon cap or a later start is acceptable and the forecast drops, a second
  option offers the same workers at the forecast low-carbon time.
* A carbon cap is a constraint: no option starts when the forecast is above it; a deadline bounds every start.
* REPARTITION offers the plan (HSDP needs at least 2 workers). DEFER offers the lowest-carbon start after
  `start_after` and before the deadline. MIGRATE_REGION is declined unless the region exists in this cloud.
* APPROVE_MAINTENANCE offers "approve now" while the job runs on a host, else declines (`approval_policy`).
* SCALE with hosts to replace (`replace_hosts`: the tenant's hosts that failed or are predicted to) takes the job's
  workers off those hosts and keeps the rest of the size on healthy hosts (`capacity` must not count the replaced
  hosts): the target if healthy hosts have room, else the most they have room for if that is inside the range (the
  reason says which workers are dropped and why), else a decline saying so. A replacement is never deferred: a
  failing host does not wait for clean power; only growth beyond the current size honours a carbon cap.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from api.services.approval_policy import approval_option
from api.services.carbon_forecast import CarbonPoint, carbon_at
from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationTerms, Offer, OfferOption, terms_problem

DEFAULT_OFFER_TTL = timedelta(seconds=60)
LOW_CARBON_MARGIN = 0.10
"""A later start is worth offering only when it is at least this much cleaner than the earliest start."""
HSDP_MIN_WORKERS = 2


@dataclass(frozen=True)
class JobSnapshot:
    """What the policy needs to know about the job."""

    min_workers: int
    max_workers: int
    gpus_per_worker: int
    desired_workers: int
    parallel_plan: ParallelPlan
    placed_hosts: int = 0


@dataclass(frozen=True)
class FreeCapacity:
    """Free GPUs per host, with each host's locality group (provider-internal; never put into a reason)."""

    hosts: tuple[tuple[str, int], ...] = ()

    @property
    def total_gpus(self) -> int:
        return sum(free for _, free in self.hosts)

    @property
    def by_group(self) -> dict[str, int]:
        groups: dict[str, int] = {}
        for group, free in self.hosts:
            groups[group] = groups.get(group, 0) + free
        return groups

    def workers(self, gpus_per_worker: int) -> int:
        """How many more workers fit, each on a single host."""
        return sum(free // gpus_per_worker for _, free in self.hosts)


@dataclass(frozen=True)
class Regions:
    """Where the job runs and which regions this cloud has."""

    current: str
    known: Collection[str]


@dataclass(frozen=True)
class Replacement:
    """The hosts a request asks to replace, by the tenant's pseudonyms (its events' names, never internal ids)."""

    hosts: tuple[str, ...] = ()
    """Named hosts that run workers of the job."""
    workers: int = 0
    """The job's workers on them (all of them leave those hosts)."""
    absent: tuple[str, ...] = ()
    """Named hosts that run none of the job's workers: nothing to move there."""


NO_REPLACEMENT = Replacement()


@dataclass(frozen=True)
class Decline:
    """The provider can offer nothing inside the tenant's terms; `reason` says why."""

    reason: str


@dataclass(frozen=True)
class _Start:
    at: datetime
    g_per_kwh: float | None


def decide(
    kind: NegotiationKind,
    terms: NegotiationTerms,
    *,
    job: JobSnapshot,
    capacity: FreeCapacity,
    carbon: Sequence[CarbonPoint],
    regions: Regions,
    now: datetime,
    offer_ttl: timedelta = DEFAULT_OFFER_TTL,
    replacing: Replacement = NO_REPLACEMENT,
) -> Offer | Decline:
    """The provider's answer to a request or counter-offer (see the module docstring for the rules)."""
    deadline = terms.constraints.deadline
    if deadline is not None and deadline <= max(now, terms.start_after or now):
        return Decline("the deadline leaves no time: it is not after the earliest start")
    if terms.replace_hosts is not None and kind is not NegotiationKind.SCALE:
        return Decline(f"replace_hosts is for scale requests, not {kind.value}")
    problem = terms_problem(kind, terms)
    if problem is not None:
        return Decline(problem)
    options: list[OfferOption] | Decline
    if kind is NegotiationKind.SCALE and replacing.workers > 0:
        options = _replace(terms, job, capacity, carbon, now, replacing)
    elif kind is NegotiationKind.SCALE:
        options = _scale(terms, job, capacity, carbon, now)
    elif kind is NegotiationKind.REPARTITION:
        options = _repartition(terms, job)
    elif kind is NegotiationKind.DEFER:
        options = _defer(terms, job, capacity, carbon, now)
    elif kind is NegotiationKind.APPROVE_MAINTENANCE:
        answer = approval_option(terms.notice_id or "", placed_hosts=job.placed_hosts)
        options = Decline(answer) if isinstance(answer, str) else [answer]
    else:
        options = _migrate(terms, regions)
    if replacing.absent:
        options = _with_note(options, f"no worker of this job runs on {_names(replacing.absent)}")
    if isinstance(options, Decline):
        return options
    return Offer(options=tuple(options), expires_at=now + offer_ttl)


def _with_note(options: list[OfferOption] | Decline, note: str) -> list[OfferOption] | Decline:
    if isinstance(options, Decline):
        return Decline(f"{options.reason}; {note}")
    return [option.model_copy(update={"reason": f"{option.reason}; {note}"[:300]}) for option in options]


def _names(hosts: Sequence[str]) -> str:
    return hosts[0] if len(hosts) == 1 else ", ".join(hosts[:-1]) + f" and {hosts[-1]}"


def _workers(count: int) -> str:
    return f"{count} worker" if count == 1 else f"{count} workers"


def _range(terms: NegotiationTerms, job: JobSnapshot) -> tuple[int, int, int] | Decline:
    """(low, high, target): the tenant's acceptable worker counts within the job's range, and the count to aim for."""
    desired, asked = terms.desired_workers, terms.accept_workers
    if asked is not None:
        asked_low, asked_high = asked.min, asked.max
    elif desired is not None:
        asked_low = asked_high = desired
    else:
        return Decline("give desired_workers or accept_workers")
    low, high = max(asked_low, job.min_workers), min(asked_high, job.max_workers)
    if low > high:
        return Decline(
            f"no worker count you accept ({_span(asked_low, asked_high)}) is allowed for this job "
            f"({_span(job.min_workers, job.max_workers)} workers)"
        )
    target = desired if desired is not None else high
    return low, high, min(max(target, low), high)


def _span(low: int | None, high: int | None) -> str:
    return f"{low}" if low == high else f"{low}-{high}"


def _earliest(terms: NegotiationTerms, now: datetime) -> datetime:
    return max(now, terms.start_after) if terms.start_after else now


def _candidates(terms: NegotiationTerms, carbon: Sequence[CarbonPoint], now: datetime) -> list[_Start]:
    """Possible starts: the earliest allowed, then each forecast interval's start before the deadline."""
    first = _earliest(terms, now)
    deadline = terms.constraints.deadline
    starts = [_Start(first, carbon_at(carbon, first))]
    starts += [_Start(at, g) for at, g in carbon if first < at and (deadline is None or at < deadline)]
    return starts


def _first_within_cap(starts: list[_Start], cap: float | None) -> _Start | None:
    if cap is None:
        return starts[0]
    return next((start for start in starts if start.g_per_kwh is not None and start.g_per_kwh <= cap), None)


def _cleaner_later(starts: list[_Start], after: _Start) -> _Start | None:
    """The lowest-carbon start after `after` (earliest on ties), if clearly cleaner than `after`."""
    later = [start for start in starts if start.at > after.at and start.g_per_kwh is not None]
    if not later or after.g_per_kwh is None:
        return None
    best = min(later, key=lambda start: (start.g_per_kwh, start.at))
    assert best.g_per_kwh is not None
    return best if best.g_per_kwh <= after.g_per_kwh * (1 - LOW_CARBON_MARGIN) else None


def _carbon_decline(cap: float, carbon: Sequence[CarbonPoint]) -> Decline:
    if not carbon:
        return Decline(f"no carbon forecast is available to meet your cap of {cap:g} g/kWh")
    return Decline(f"carbon is forecast above your cap of {cap:g} g/kWh for every start before your deadline")


def _when(start: _Start, now: datetime) -> str:
    return "now" if start.at <= now else f"from {start.at.strftime('%Y-%m-%dT%H:%M:%SZ')}"


def _carbon_note(start: _Start, cap: float | None) -> str:
    if start.g_per_kwh is None:
        return ""
    note = f", carbon forecast {start.g_per_kwh:.0f} g/kWh"
    return note + (f" (your cap: {cap:g})" if cap is not None else "")


def _option(workers: int | None, start: _Start, now: datetime, reason: str, **extra: object) -> OfferOption:
    return OfferOption(
        workers=workers,
        start_at=None if start.at <= now else start.at,
        expected_carbon_g_per_kwh=start.g_per_kwh,
        reason=reason[:300],
        **extra,
    )


def _scale(
    terms: NegotiationTerms, job: JobSnapshot, capacity: FreeCapacity, carbon: Sequence[CarbonPoint], now: datetime
) -> list[OfferOption] | Decline:
    bounds = _range(terms, job)
    if isinstance(bounds, Decline):
        return bounds
    low, high, target = bounds
    current = job.desired_workers
    starts = _candidates(terms, carbon, now)
    if target <= current:
        if starts[0].at > now:
            return Decline("a shrink takes effect at once; it is not offered for a later start")
        what = "already running" if target == current else f"down from {current}, at once"
        return [_option(target, starts[0], now, f"{target} workers now ({what})")]
    room = capacity.workers(job.gpus_per_worker)
    fits = min(target, current + room)
    if fits < low or fits <= current:
        return Decline(
            f"no room now for more workers: the job has {current}, there is room for {room} more "
            f"({job.gpus_per_worker} GPU(s) each, on one host), and you accept {_span(low, high)}"
        )
    cap = terms.constraints.carbon_cap_g_per_kwh
    first = _first_within_cap(starts, cap)
    if first is None:
        assert cap is not None
        return _carbon_decline(cap, carbon)
    short = "" if fits == target else f"; room for {fits - current} more now, not {target - current}"
    options = [_option(fits, first, now, f"{fits} workers {_when(first, now)}{short}{_carbon_note(first, cap)}")]
    later_acceptable = cap is not None or terms.constraints.deadline is not None or terms.start_after is not None
    cleaner = _cleaner_later(starts, first) if later_acceptable else None
    if cleaner is not None:
        reason = f"{fits} workers {_when(cleaner, now)}, the forecast low-carbon time{_carbon_note(cleaner, cap)}"
        options.append(_option(fits, cleaner, now, reason))
    return options


def _replace(
    terms: NegotiationTerms,
    job: JobSnapshot,
    capacity: FreeCapacity,
    carbon: Sequence[CarbonPoint],
    now: datetime,
    replacing: Replacement,
) -> list[OfferOption] | Decline:
    """Take the job's workers off the replaced hosts and reach the target with workers on healthy hosts."""
    bounds = _range(terms, job)
    if isinstance(bounds, Decline):
        return bounds
    low, high, target = bounds
    if _earliest(terms, now) > now:
        return Decline("a replacement takes effect at once; it is not offered for a later start")
    current, where = job.desired_workers, _names(replacing.hosts)
    kept = current - replacing.workers
    room = capacity.workers(job.gpus_per_worker)
    wanted = max(0, target - kept)
    new = min(wanted, room)
    start = _Start(now, carbon_at(carbon, now))
    cap = terms.constraints.carbon_cap_g_per_kwh
    held_back = ""
    if kept + new > current and cap is not None and (start.g_per_kwh is None or start.g_per_kwh > cap):
        new = replacing.workers
        held_back = f"; no growth now: carbon is not forecast within your cap of {cap:g} g/kWh"
    workers = kept + new
    if workers < low:
        return Decline(
            f"no healthy host has room to replace the job's {_workers(replacing.workers)} on {where}: there is room "
            f"for {room} ({job.gpus_per_worker} GPU(s) each, on one host), the job keeps {kept} elsewhere, and you "
            f"accept {_span(low, high)}"
        )
    moved = min(new, replacing.workers)
    dropped = replacing.workers - moved
    parts = []
    if moved:
        parts.append(f"{_workers(moved)} on {where} {'moves' if moved == 1 else 'move'} to a healthy host")
    if dropped:
        why = "no healthy host has room to replace it" if new < wanted else "you asked for fewer"
        parts.append(f"{_workers(dropped)} on {where} {'is' if dropped == 1 else 'are'} dropped ({why})")
    if new > moved:
        parts.append(f"{new - moved} more on healthy hosts")
    if workers < kept:
        parts.append(f"{kept - workers} more released")
    if not dropped and not held_back and new < wanted:
        held_back = f"; no room on healthy hosts for {wanted - new} more"
    reason = f"{workers} workers now: {', '.join(parts)}{held_back}{_carbon_note(start, cap)}"
    return [_option(workers, start, now, reason, replaced_hosts=replacing.hosts)]


def _repartition(terms: NegotiationTerms, job: JobSnapshot) -> list[OfferOption] | Decline:
    plan = terms.parallel_plan
    if plan is None:
        return Decline("give parallel_plan")
    if plan is job.parallel_plan:
        return Decline(f"the job already runs {plan.value}")
    if plan is ParallelPlan.HSDP and job.desired_workers < HSDP_MIN_WORKERS:
        return Decline(f"hsdp needs at least {HSDP_MIN_WORKERS} workers; the job has {job.desired_workers}")
    reason = f"switch from {job.parallel_plan.value} to {plan.value} at once; workers unchanged ({job.desired_workers})"
    return [OfferOption(parallel_plan=plan, reason=reason)]


def _defer(
    terms: NegotiationTerms, job: JobSnapshot, capacity: FreeCapacity, carbon: Sequence[CarbonPoint], now: datetime
) -> list[OfferOption] | Decline:
    if terms.parallel_plan is not None:
        return Decline("a deferred plan change is not offered: ask for repartition")
    current = job.desired_workers
    if terms.desired_workers is None and terms.accept_workers is None:
        if current == 0:
            return Decline("the job has no workers to defer: give desired_workers")
        low = high = target = current
    else:
        bounds = _range(terms, job)
        if isinstance(bounds, Decline):
            return bounds
        low, high, target = bounds
    if target < current:
        return Decline("shrinking is offered at once, never deferred: ask for scale")
    room = capacity.workers(job.gpus_per_worker)
    workers = min(target, current + room)
    if workers < low:
        return Decline(
            f"no room to reserve {_span(low, high)} workers for a later start: the job has {current}, "
            f"there is room for {room} more"
        )
    later = [start for start in _candidates(terms, carbon, now) if start.g_per_kwh is not None]
    if not later:
        return Decline("no carbon forecast covers the window from start_after to the deadline")
    best = min(later, key=lambda start: (start.g_per_kwh, start.at))
    cap = terms.constraints.carbon_cap_g_per_kwh
    if cap is not None and best.g_per_kwh is not None and best.g_per_kwh > cap:
        return _carbon_decline(cap, carbon)
    short = "" if workers == target else f"; room to reserve {workers - current} more, not {target - current}"
    reason = (
        f"{workers} workers {_when(best, now)}, the lowest-carbon start in your window{short}{_carbon_note(best, cap)}"
    )
    return [_option(workers, best, now, reason)]


def _migrate(terms: NegotiationTerms, regions: Regions) -> list[OfferOption] | Decline:
    if terms.region is None:
        return Decline("give region")
    known = {region.upper(): region for region in regions.known}
    wanted = terms.region.upper()
    names = ", ".join(sorted(regions.known)) or "none"
    if wanted not in known:
        return Decline(f"region {terms.region} does not exist in this cloud (regions: {names})")
    if wanted == regions.current.upper():
        return Decline(f"the job already runs in {regions.current} (regions of this cloud: {names})")
    region = known[wanted]
    return [OfferOption(region=region, reason=f"move to {region}: checkpoint, stop here, resume there")]
