"""The agent's side of a tenant's "go ahead now": start an announced maintenance early, once, when all may.

A tenant accepts an `approve_maintenance` negotiation naming a notice as its Maintenance event does (its per-tenant
pseudonym). The control plane cannot tell which notice that is; it lists the approval in the desired state of every
host of the job (`AssignedJob.approvals`). On each pass the agent compares each approval with the notices it holds,
pseudonymised for the approval's tenant by the function the projection uses (`notice_pseudonym`): an approval that
names none of them is for another host of the job (or a notice gone), and is left to others. For a notice it holds:

| the notice                                                   | outcome reported (a round of the negotiation)     |
|--------------------------------------------------------------|---------------------------------------------------|
| already asked for (`ApprovalMemory`)                         | what the cloud answered then (never asked twice)  |
| from a source without early starts (AWS, GCP, simulated)     | `approval_failed`: this cloud has no early approval|
| started, over, not `early_approval`, or refused by channel   | `approval_failed`, saying which                   |
| another tenant with jobs on the host has not approved it     | `approval_pending`: waiting for the others        |
| every tenant with jobs on the host approved it (or one alone)| the channel's `approve`: `approved` or `failed`   |

Reports carry tenant terms only (never a VM name or the cloud's event id) and are sent once per outcome by this
process; the control plane takes repeats as duplicates, so a restarted agent simply reports again. A final outcome
takes the approval off the desired state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from harmonaize.desired_state import HostAssignment, MaintenanceApproval
from harmonaize.events import MaintenanceStatus
from harmonaize.negotiation import RoundAction
from provider_agents.approval_memory import ApprovalMemory, Approving, Remembered
from provider_agents.clock import Clock, SystemClock
from provider_agents.control_plane import ControlPlaneRefusal
from provider_agents.projection import notice_pseudonym
from provider_agents.telemetry.model import HostTelemetry, MaintenanceNotice
from provider_agents.telemetry.notices.channel import EarlyStartChannel, NoticeError, SignalChannel

__all__ = ["APPROVAL_INTERVAL_S", "ApprovalReporter", "HeldNotice", "NoticeApprover", "held_notices"]

log = logging.getLogger(__name__)

APPROVAL_INTERVAL_S = 0.25

NO_EARLY_APPROVAL = "this cloud has no early approval: the maintenance keeps its scheduled time"
NOT_EARLY = "this maintenance cannot be started early: it keeps its scheduled time"
WAITING = "waiting for the other tenants on the host: a shared host's maintenance starts early only once all approve"
APPROVED = "approved at the cloud: the maintenance may start now"
UNKNOWN = "outcome unknown: the provider's agent restarted while asking the cloud; the maintenance starts at its "
UNKNOWN += "scheduled time at the latest"
STATUS_NOTES = {
    MaintenanceStatus.STARTED: "the maintenance has already started",
    MaintenanceStatus.COMPLETED: "the maintenance is over",
    MaintenanceStatus.CANCELLED: "the maintenance was cancelled",
}


class ApprovalReporter(Protocol):
    """Where outcomes go: the control plane's `POST /v1/provider/approvals` (`ControlPlane.report_approval`)."""

    async def report_approval(self, negotiation: str, outcome: RoundAction, note: str) -> str:
        """`recorded` or `duplicate`; raises `ControlPlaneRefusal` when refused."""
        ...


@dataclass(frozen=True)
class HeldNotice:
    """A maintenance notice of this host and the channel that could start it early (None: nothing can)."""

    notice: MaintenanceNotice
    channel: EarlyStartChannel | None = None


def held_notices(telemetry: HostTelemetry | None, channels: Iterable[SignalChannel]) -> list[HeldNotice]:
    """The notices in the agent's latest sample (what its tenants were told), each with the early-start channel it
    came from, if any."""
    if telemetry is None:
        return []
    starters: dict[str, EarlyStartChannel] = {}
    for channel in channels:
        if isinstance(channel, EarlyStartChannel):
            for notice in channel.view(telemetry.sampled_at).maintenance:
                starters[notice.notice_id] = channel
    return [HeldNotice(notice, starters.get(notice.notice_id)) for notice in telemetry.maintenance]


@dataclass(frozen=True)
class _Asked:
    tenant: str
    approval: MaintenanceApproval


class NoticeApprover:
    """One host's approvals: `step()` is one pass (the runtime calls it every `APPROVAL_INTERVAL_S`)."""

    def __init__(
        self,
        *,
        host: str,
        secret: bytes,
        assignment: Callable[[], HostAssignment | None],
        notices: Callable[[], Sequence[HeldNotice]],
        reporter: ApprovalReporter,
        memory: ApprovalMemory,
        clock: Clock | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the approver needs the provider secret to match the tenants' notice ids")
        self.host = host
        self._secret = secret
        self._assignment = assignment
        self._notices = notices
        self._reporter = reporter
        self._memory = memory
        self._clock: Clock = clock or SystemClock()
        self._reported: dict[str, RoundAction] = {}

    async def step(self) -> None:
        """Match the host's approvals to its notices and act on each notice asked for (see the module table)."""
        assignment = self._assignment()
        if assignment is None:
            return
        asked = [_Asked(job.tenant, approval) for job in assignment.jobs for approval in job.approvals]
        if not asked:
            return
        tenants = {job.tenant for job in assignment.jobs}
        for held in self._notices():
            names = {tenant: notice_pseudonym(self._secret, tenant, held.notice.notice_id) for tenant in tenants}
            mine = [one for one in asked if one.approval.notice == names[one.tenant]]
            if not mine:
                continue
            outcome, note = await self._decide(held, approving={one.tenant for one in mine}, tenants=tenants)
            for one in mine:
                await self._report(one.approval.negotiation, outcome, note)

    async def _decide(self, held: HeldNotice, *, approving: set[str], tenants: set[str]) -> tuple[RoundAction, str]:
        notice, channel = held.notice, held.channel
        remembered = self._memory.get(notice.notice_id)
        if remembered is not None:
            return _outcome(remembered)
        if channel is None:
            return RoundAction.APPROVAL_FAILED, NO_EARLY_APPROVAL
        if notice.status is not MaintenanceStatus.SCHEDULED:
            return RoundAction.APPROVAL_FAILED, f"{STATUS_NOTES[notice.status]}: too late to start it early"
        if not notice.early_approval:
            return RoundAction.APPROVAL_FAILED, NOT_EARLY
        refusal = channel.early_start_refusal(notice.notice_id)
        if refusal is not None:
            return RoundAction.APPROVAL_FAILED, refusal
        if approving != tenants:
            log.debug("host %s: notice %s: %d of %d tenants on the host approved; waiting for the others",
                      self.host, notice.notice_id, len(approving), len(tenants))
            return RoundAction.APPROVAL_PENDING, WAITING
        return _outcome(await self._approve(notice.notice_id, channel))

    async def _approve(self, notice_id: str, channel: EarlyStartChannel) -> Remembered:
        """Ask the cloud once; the intent is on disk before the request, the answer after it."""
        self._memory.remember(notice_id, Approving.SENDING, at=self._clock.now())
        try:
            await channel.approve(notice_id)
        except NoticeError as exc:
            log.warning("host %s: %s refused the early start of %s: %s", self.host, channel.name, notice_id, exc)
            note = "the cloud refused the early start: the maintenance keeps its scheduled time"
            return self._memory.remember(notice_id, Approving.REFUSED, at=self._clock.now(), note=note)
        log.info("host %s: %s: asked the cloud to start %s now", self.host, channel.name, notice_id)
        return self._memory.remember(notice_id, Approving.APPROVED, at=self._clock.now(), note=APPROVED)

    async def _report(self, negotiation: str, outcome: RoundAction, note: str) -> None:
        if self._reported.get(negotiation) is outcome:
            return
        try:
            answer = await self._reporter.report_approval(negotiation, outcome, note)
        except ControlPlaneRefusal as exc:  # refused stays refused: say so once instead of retrying every pass
            log.error("host %s: the control plane refused the %s report of %s: %s",
                      self.host, outcome.value, negotiation, exc.reason)
            answer = "refused"
        except Exception as exc:  # the control plane is away: the next pass reports again
            log.warning("host %s: reporting %s of %s failed: %r", self.host, outcome.value, negotiation, exc)
            return
        log.info("host %s: approval %s: %s (%s)", self.host, negotiation, outcome.value, answer)
        self._reported[negotiation] = outcome


def _outcome(remembered: Remembered) -> tuple[RoundAction, str]:
    if remembered.state is Approving.APPROVED:
        return RoundAction.APPROVED, remembered.note or APPROVED
    if remembered.state is Approving.REFUSED:
        return RoundAction.APPROVAL_FAILED, remembered.note
    return RoundAction.APPROVAL_FAILED, UNKNOWN
