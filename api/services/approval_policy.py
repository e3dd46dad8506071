"""The provider's answer to an `approve_maintenance` request: a part of the negotiation policy, pure like it.

The control plane does not know the notices (each host's agent does, under the cloud's own ids), but it knows where
the job runs. So it offers one option, "approve now", while the job runs on at least one host, and declines when it
runs nowhere. Whether the notice exists on the job's hosts and may start early is for their agents to find out after
the accept; their outcome is added to the negotiation's rounds. On a host shared with other tenants the notice starts
early only once each of them has approved it too, which the option's reason says, as a rule and not as a fact about
this job's hosts.
"""

from __future__ import annotations

from harmonaize.negotiation import OfferOption

__all__ = ["approval_option"]


def approval_option(notice_id: str, *, placed_hosts: int) -> OfferOption | str:
    """The one option to offer, or the reason to decline."""
    if placed_hosts == 0:
        return "the job runs on no host now: there is no maintenance of it to approve"
    reason = (
        f"approve maintenance {notice_id} now: the job's hosts ask the cloud to start it early (a host shared with "
        "other tenants only once they approve it too); the outcome is added to this negotiation's rounds"
    )
    return OfferOption(reason=reason[:300])
