"""The provider's agents report what became of an accepted maintenance approval (admin token).

The tenant's side of an approval is an ordinary negotiation (`routes.negotiations`, kind `approve_maintenance`); its
outcome arrives here from the agent that holds the notice, and is shown to the tenant as a provider round of that
negotiation. Reports are idempotent: an agent reports level state, again after a restart. The negotiation is named
in the body, like every provider report's subject (progress, node failures).
"""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AdminDep, NowDep, SessionDep, WakeRelayDep
from api.schemas import ApprovalReportBody, ApprovalReportPublic
from api.services.maintenance_approvals import report_outcome
from harmonaize.negotiation import RoundAction

router = APIRouter(tags=["maintenance approvals"])


@router.post("/provider/approvals")
async def report_approval(
    body: ApprovalReportBody, _admin: AdminDep, session: SessionDep, now: NowDep, wake: WakeRelayDep
) -> ApprovalReportPublic:
    """Add an agent's outcome (`approval_pending`, `approved`, `approval_failed`) as a round of the negotiation.

    404 unless the negotiation is an accepted approve_maintenance one; 409 for an outcome that contradicts a final
    one (approved, then failed); a repeated report is a `duplicate`. A final outcome takes the approval off the
    desired state of the job's hosts.
    """
    report = await report_outcome(
        session, negotiation_id=body.negotiation, outcome=RoundAction(body.outcome), note=body.note or None, now=now
    )
    wake()
    return ApprovalReportPublic.model_validate({"outcome": report.outcome, "status": report.status.value})
