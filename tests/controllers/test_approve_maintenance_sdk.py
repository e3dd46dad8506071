"""The tenant SDK's `Job.approve_maintenance`: an `approve_maintenance` negotiation naming the notice as the
Maintenance event does, returned as an `Offer` like every other request (fast tier, the SDK's fake provider).

The provider's side (the command to the agents, the cloud's outcome as rounds) is tested in
tests/api/test_negotiation_approve_maintenance.py and tests/agents/test_azure_approval.py.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from harmonaize.events import Maintenance, MaintenanceKind, MaintenanceStatus, MaintenanceWindow
from harmonaize.negotiation import NegotiationKind, NegotiationState
from tenant_controllers import Controller, Declined, Job
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.testing import ControllerHarness
from tests.controllers.fake_provider import FakeProvider

NOTICE = "m-0123456789abcdef"


async def test_approve_maintenance_opens_the_negotiation_and_accepting_it_is_the_approval(
    provider: FakeProvider, api: ProviderApi
) -> None:
    job = await Job("llm-finetune", api=api).refresh()
    offer = await job.approve_maintenance(NOTICE)
    offered = offer.state
    assert offered is NegotiationState.OFFERED and offer.kind is NegotiationKind.APPROVE_MAINTENANCE
    (option,) = offer.options
    assert option.workers is None and NOTICE in option.reason
    await offer.accept()
    assert offer.state is NegotiationState.ACCEPTED
    assert (await job.refresh()).workers == 2, "an approval changes no size"

    [post] = provider.posts()
    body = json.loads(post.content)
    assert (body["job"], body["kind"], body["terms"]["notice_id"]) == ("llm-finetune", "approve_maintenance", NOTICE)
    assert set(body["terms"]) <= {"notice_id", "constraints"} and not body["terms"].get("constraints")
    assert post.headers["idempotency-key"].startswith("hz-")
    listed = [n.id async for n in job.negotiations(kind=NegotiationKind.APPROVE_MAINTENANCE)]
    assert listed == [offer.id]


async def test_a_job_placed_nowhere_is_declined_and_a_malformed_notice_is_never_sent(
    provider: FakeProvider, api: ProviderApi
) -> None:
    provider.add_job("parked", desired=0)
    parked = await Job("parked", api=api).refresh()
    with pytest.raises(Declined) as declined:
        await parked.approve_maintenance(NOTICE)
    assert declined.value.negotiation.kind is NegotiationKind.APPROVE_MAINTENANCE
    assert "runs on no host" in str(declined.value)

    job = await Job("llm-finetune", api=api).refresh()
    for bad in ("M-UPPER", "hz.t.globex.>", ""):
        with pytest.raises(ValidationError):
            await job.approve_maintenance(bad)
    assert len(provider.posts()) == 1, "only the parked job's request went out"


async def test_a_controller_approves_announced_maintenance_it_is_ready_for() -> None:
    ctl = Controller(job="train")

    @ctl.on(Maintenance)
    async def go_ahead(event: Maintenance, job: Job) -> None:
        """Checkpointed often enough: let maintenance that may start early start now."""
        if event.early_approval and event.status is MaintenanceStatus.SCHEDULED:
            offer = await job.approve_maintenance(event.notice_id)
            await offer.accept()

    soon = datetime.now(UTC) + timedelta(minutes=15)
    notice = Maintenance(
        notice_id=NOTICE, kind=MaintenanceKind.REBOOT, status=MaintenanceStatus.SCHEDULED,
        window=MaintenanceWindow(not_before=soon, not_after=soon + timedelta(minutes=10)),
        hosts=("h-0123456789abcdef",), early_approval=True,
    )
    waiting_only = notice.model_copy(update={"notice_id": "m-fedcba9876543210", "early_approval": False})
    async with ControllerHarness(ctl, workers=2) as h:
        await h.publish(waiting_only)
        await h.publish(notice, duplicate=True)
        asked = await h.provider.next_negotiation()
        await h.settle()
    assert (asked.kind, asked.terms.notice_id) == (NegotiationKind.APPROVE_MAINTENANCE, NOTICE)
    assert h.provider.negotiation(asked.id).state is NegotiationState.ACCEPTED
    assert len(h.provider.negotiations) == 1, "the duplicate was handled once; the other notice asked for nothing"
