"""What becomes of an accepted maintenance approval, as an explicit transition table over the agents' reports.

The negotiation itself ends at `accepted` (`negotiation_lifecycle`); the approval it asked for lives on until the
agents of the job's hosts report an outcome. Each report is a provider round (`RoundAction.APPROVAL_PENDING`,
`APPROVED`, `APPROVAL_FAILED`) and moves the approval along this table. A report that repeats the current status is
a duplicate (agents report level state, and re-report after a restart): no new round; so is a "still waiting" that
arrives after the outcome (a retried request overtaken by the final report). Anything else not listed is refused
with `ApprovalConflictError` (409): an approval the cloud accepted cannot fail afterwards, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from api.models_approvals import ApprovalStatus
from api.services.errors import ConflictError
from harmonaize.negotiation import RoundAction

_Q, _P = ApprovalStatus.QUEUED, ApprovalStatus.PENDING

TRANSITIONS: Final[Mapping[tuple[ApprovalStatus, RoundAction], ApprovalStatus]] = {
    # An agent holds the notice, but another tenant with jobs on that host has not approved it yet: wait for them.
    (_Q, RoundAction.APPROVAL_PENDING): _P,
    # Every tenant on the host approved (or the job's tenant is alone there); the cloud accepted the early start.
    (_Q, RoundAction.APPROVED): ApprovalStatus.APPROVED,
    # No early start: the cloud has no early approval, the notice allows none or has started, the cloud refused,
    # or no agent could act on it in time (the sweeper). Final; the notice starts at its scheduled time.
    (_Q, RoundAction.APPROVAL_FAILED): ApprovalStatus.FAILED,
    # The last of the host's other tenants approved too; the cloud accepted the early start.
    (_P, RoundAction.APPROVED): ApprovalStatus.APPROVED,
    # While waiting, the notice started, went away or was refused, or the wait outlived the approval (the sweeper).
    (_P, RoundAction.APPROVAL_FAILED): ApprovalStatus.FAILED,
}

OUTCOMES: Final = (RoundAction.APPROVAL_PENDING, RoundAction.APPROVED, RoundAction.APPROVAL_FAILED)
"""The rounds an agent may report."""

REPEATS: Final[Mapping[RoundAction, ApprovalStatus]] = {
    RoundAction.APPROVAL_PENDING: _P,
    RoundAction.APPROVED: ApprovalStatus.APPROVED,
    RoundAction.APPROVAL_FAILED: ApprovalStatus.FAILED,
}
"""The status each outcome leads to: a report finding its approval there already is a duplicate."""


class ApprovalConflictError(ConflictError):
    """The report contradicts the approval's outcome so far; nothing changed."""

    def __init__(self, status: ApprovalStatus, action: RoundAction) -> None:
        super().__init__(f"the maintenance approval is {status.value}: cannot record {action.value}")
        self.status = status
        self.action = action


FINAL: Final = (ApprovalStatus.APPROVED, ApprovalStatus.FAILED)


def next_approval_status(status: ApprovalStatus, action: RoundAction) -> ApprovalStatus | None:
    """Where `action` leads from `status`; None for a duplicate; ApprovalConflictError when not allowed."""
    if REPEATS.get(action) is status or (action is RoundAction.APPROVAL_PENDING and status in FINAL):
        return None
    try:
        return TRANSITIONS[(status, action)]
    except KeyError:
        raise ApprovalConflictError(status, action) from None
